# lanes.py's functions as the dispatch core calls them (C calls, compiled).
from dstack.runtime.core_state cimport _Model

cdef bint mates_busy(list ms, _Model st, double now)
cdef double lane_start(list ms, object policy, _Model st, double deadline, double now,
                       double own_s)
cdef double guest_finish(list ms, object policy, _Model st, long long items, double now)
