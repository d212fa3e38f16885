# Two commands do everything on a fresh clone:  make serve   and   make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
BUILT := $(VENV)/.built-stamp
CONFIG ?= configs/default.yaml
PYTEST_ARGS ?=

.PHONY: setup browser serve test lint loadtest bench bench-closed-loop bench-retry bench-triton bench-policies bench-priority bench-bursty chaos soak clean

setup: $(BUILT)

# The virtual environment is made if missing and re-installed when the pins change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24"
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,ray]'
	touch $(STAMP)

# The install compiles the simulator's hot path (setup.py); a changed source is compiled
# again here (only what changed), so a stale extension module never shadows it.
$(BUILT): $(STAMP) setup.py $(wildcard dstack/*.py dstack/*/*.py dstack/*/*.pxd)
	$(PY) setup.py -q build_ext --inplace
	touch $(BUILT)

serve: $(BUILT)
	$(VENV)/bin/dstack serve --config $(CONFIG)

# The dashboard's browser test drives Debian's chromium with selenium. As root with apt-get
# (CI, a fresh machine) this installs chromium and its driver when missing; elsewhere, or
# if the install fails, that one test is skipped and says why.
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends chromium chromium-driver >/dev/null) \
	      || echo "chromium could not be installed: the browser test will be skipped"; \
	  else echo "no chromium (not root): the dashboard's browser test will be skipped"; fi; fi

test: $(BUILT) browser
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Load test a running server (make serve in another terminal): Locust headless for
# DURATION, RATE requests/s in total at the peak of SHAPE (steady|steps|burst). Models and
# SLOs come from the server; SLO_MS (one number or model=ms,...) or SLO_CONFIG (a
# deployment file) override them. Reports under LOADTEST_OUT. PROTOCOL: http (binary
# tensors), grpc (the gRPC endpoint at GRPC_URL, default HOST's name on port 8001) or shm
# (HTTP with the tensors in system shared memory: a server on this host started with
# --allow-client-shm).
HOST ?= http://127.0.0.1:8000
PROTOCOL ?= http
GRPC_URL ?=
DURATION ?= 30s
USERS ?= 4
RATE ?= 8
SHAPE ?= steady
SLO_MS ?=
SLO_CONFIG ?=
LOADTEST_OUT ?= out/loadtest

loadtest: $(STAMP)
	mkdir -p $(LOADTEST_OUT)
	rm -f $(LOADTEST_OUT)/outcomes.json
	$(PY) -m loadtests.summary scrape --host $(HOST) --out $(LOADTEST_OUT)/metrics_before.prom
	$(VENV)/bin/locust -f loadtests/locustfile.py --headless \
		--host $(HOST) -u $(USERS) -r $(USERS) -t $(DURATION) --stop-timeout 10 \
		--rate $(RATE) --shape $(SHAPE) $(if $(SLO_CONFIG),--dstack-config $(SLO_CONFIG)) \
		--protocol $(PROTOCOL) $(if $(GRPC_URL),--grpc-url $(GRPC_URL)) \
		$(if $(SLO_MS),--slo-ms $(SLO_MS)) --outcomes-json $(LOADTEST_OUT)/outcomes.json \
		--csv $(LOADTEST_OUT)/locust --html $(LOADTEST_OUT)/report.html \
		--only-summary --exit-code-on-error 0 --loglevel WARNING
	$(PY) -m loadtests.summary scrape --host $(HOST) --out $(LOADTEST_OUT)/metrics_after.prom
	$(PY) -m loadtests.summary report --csv-prefix $(LOADTEST_OUT)/locust \
		--outcomes $(LOADTEST_OUT)/outcomes.json --duration $(DURATION) \
		--before $(LOADTEST_OUT)/metrics_before.prom --after $(LOADTEST_OUT)/metrics_after.prom \
		--out $(LOADTEST_OUT)/summary.json

# Every policy side by side on one machine, against the in-process ceiling (< 15 min).
BENCH_ARGS ?=

bench: $(BUILT)
	$(PY) -m bench.bench_mix $(BENCH_ARGS)

# The four policies on the bench mix under closed-loop clients (2 tritonclient clients per
# model, each sending its next request when the last is answered) for CLOSED_LOOP_DURATION
# each; outcomes per model, 429s by reason, in out/bench/closed_loop.json (~3 minutes).
CLOSED_LOOP_DURATION ?= 10s
CLOSED_LOOP_ARGS ?=

bench-closed-loop: $(BUILT)
	$(PY) -m bench.bench_closed_loop --duration $(CLOSED_LOOP_DURATION) $(CLOSED_LOOP_ARGS)

# Clients that send again the moment they are refused: 2 and 8 per model, every policy and
# a plain queueing server side by side, against the machine's in-process capacity.
bench-retry: $(BUILT)
	$(PY) -m bench.bench_closed_loop --duration $(CLOSED_LOOP_DURATION) --clients 2,8 \
		--refusal-pause 0 --capacity --policies temporal,shared,spatial,dstack,queueing \
		--out out/bench-retry $(CLOSED_LOOP_ARGS)

# dstack beside Triton itself: PyTriton 0.7.0's tritonserver in a venv of its own (.venv-triton,
# made on first use, with the same torch), serving the same models with the same batching
# (bench/pytriton_serve.py). The closed loop of bench-retry (2 and 8 retrying clients per
# model, dstack and triton) and bench_protocols' HTTP, gRPC and system shm (8 and 64 client
# threads), 10 s windows; dstack / Triton for each (~10 minutes, the venv's install apart).
TRITON_VENV ?= .venv-triton
TRITON_PY := $(TRITON_VENV)/bin/python
TRITON_STAMP := $(TRITON_VENV)/.installed-stamp

$(TRITON_STAMP): bench/pytriton_sitecustomize.py
	test -x $(TRITON_PY) || $(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_PY) -m pip install -q nvidia-pytriton==0.7.0 torch==2.14.1 torchvision==0.29.1
	cp bench/pytriton_sitecustomize.py \
		"$$($(TRITON_PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/sitecustomize.py"
	touch $(TRITON_STAMP)

bench-triton: $(BUILT) $(TRITON_STAMP)
	$(PY) -m bench.bench_closed_loop --duration $(CLOSED_LOOP_DURATION) --clients 2,8 \
		--refusal-pause 0 --policies dstack --triton-python $(TRITON_PY) --out out/bench-triton
	$(PY) -m bench.bench_protocols --seconds 10 --clients 8,64 --triton-python $(TRITON_PY)

# The policy suite in the simulator: 40 seeded random mixes and reference-v100, every
# policy, dstack against the best baseline and the ideal bound (docs/simulator.md; a few
# minutes). Flags, e.g.: BENCH_POLICIES_ARGS="--mixes 60 --seed 2 --jobs 2 --duration 60".
BENCH_POLICIES_ARGS ?=

bench-policies: $(BUILT)
	$(PY) -m bench.bench_policies $(BENCH_POLICIES_ARGS)

# priority: low (FIKIT): a low-priority model flooding at 3x beside planned ones, against
# the planned models alone and against shared; the simulator, and with BENCH_PRIORITY_ARGS=
# --real also real servers on this CPU (~2 minutes more).
BENCH_PRIORITY_ARGS ?=

bench-priority: $(BUILT)
	$(PY) -m bench.bench_priority $(BENCH_PRIORITY_ARGS)

# Bursty arrivals on the real CPU server (issue 64): per policy and per multiple of the mix's
# rates, a fresh server replays `bursty:compress=10` open loop, the simulator's prediction
# beside each, dstack / shared and dstack / spatial against the targets; every number in
# out/bench/bench_bursty.json (~7 minutes). E.g. BENCH_BURSTY_ARGS="--duration 60 --seed 2
# --workload replay:trace.csv:compress=10".
BENCH_BURSTY_ARGS ?=

bench-bursty: $(BUILT)
	$(PY) -m bench.bench_bursty $(BENCH_BURSTY_ARGS)

# Overload (1x/2x/4x of capacity), worker kill -9, big JSON bodies, slowloris, stalled
# uploads, SIGTERM under load, 100,000 fuzzed requests and the server's CPU per refusal
# against real CPU servers; one table, every number in out/chaos/chaos.json
# (docs/limits.md; ~35 minutes, most of it the fuzzer).
# E.g. CHAOS_ARGS="--only overload slowloris --fuzz 10000".
CHAOS_ARGS ?=

chaos: $(BUILT)
	$(PY) -m bench.bench_chaos $(CHAOS_ARGS)

# 30 minutes at 70% of capacity: attainment and memory start/end (not in the suite).
# E.g. SOAK_ARGS="--minutes 5".
SOAK_ARGS ?=

soak: $(BUILT)
	$(PY) -m bench.soak $(SOAK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
	find dstack -name '*.so' -delete -o -name '*.c' -delete
