# The C layout of core_state.py's extension types, for the modules that cimport them
# (dispatch.py, lanes.py): keep every field and C method here in step with the .py.

cdef class Ticket:
    cdef public int model
    cdef public long long n
    cdef public double arrival
    cdef public double deadline
    cdef public object payload
    cdef public bint behind

cdef class Refusal:
    cdef readonly Ticket ticket
    cdef readonly object reason
    cdef readonly str message
    cdef readonly double stands_s

cdef class Batch:
    cdef readonly str model
    cdef readonly int index
    cdef readonly tuple tickets
    cdef readonly long long n
    cdef readonly double started
    cdef readonly bint reuse

cdef class Failure:
    cdef readonly tuple tickets
    cdef readonly str message
    cdef readonly object error

cdef class Step:
    cdef readonly tuple launches
    cdef readonly tuple refusals
    cdef readonly tuple failures
    cdef readonly object wake_at

cdef class Counters:
    cdef public long long arrived
    cdef public long long admitted
    cdef public dict refused
    cdef public long long served
    cdef public long long within_slo
    cdef public long long failed
    cdef public long long batches
    cdef public long long items
    cdef public double queue_s
    cdef public double compute_s

cdef class _Model:
    cdef object spec
    cdef str name
    cdef double slo_s
    cdef long long max_batch
    cdef long long max_queue
    cdef list queue
    cdef Py_ssize_t head
    cdef Py_ssize_t qlen
    cdef long long items
    cdef long long arrived
    cdef double head_arrival
    cdef double head_deadline
    cdef public bint running
    cdef double run_until
    cdef double run_high_until
    cdef double last_done
    cdef bint est_refused
    cdef bint probing
    cdef double probed_at
    cdef double probe_deadline
    cdef double multi_at
    cdef bint joinable
    cdef bint slope_probe
    cdef double launched_at
    cdef bint passed_over
    cdef Counters counters
    cdef object estimate
    cdef bint trusted
    cdef double one_s
    cdef double overhead_s
    cdef double delivery_s
    cdef double rate
    cdef double rate_at
    cdef double margin
    cdef object unserved
    cdef list holds
    cdef list mates
    cdef list mate_kinds
    cdef Py_ssize_t host
    cdef list guests
    cdef bint dirty

    cpdef void learned(self)
    cdef double rate_now(self, double now)
    cdef void outcome(self, Ticket t, bint missed)
    cdef void push(self, Ticket t)
    cdef Ticket first(self)
    cdef Ticket pop(self)
