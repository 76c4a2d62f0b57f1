# The newcomer's two commands:
#   make demo   set up, then run the main job (checkpoint, kill, restore a live process)
#   make test   set up, then run the test suite
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.smr-installed

.PHONY: setup demo test test-stress lint clean bench-storage bench-watcher

setup: $(STAMP) .tools/.installed-v3 .tools/bin/smr-init .tools/bin/smr-runtime .tools/lib/criu-limits.so \
       .tools/lib/criu-root.so

.tools/.installed-v3: scripts/install-tools.sh
	./scripts/install-tools.sh

# The pod containers' PID 1 (services/agent/init): static, so it runs in any image.
.tools/bin/smr-init: services/agent/init/smr-init.c .tools/.installed-v3
	gcc -static -Os -Wall -Wextra -o $@ $<

# Preloaded into CRIU (smr.process.criu): reads the limits of a task of another user
# from /proc where root lacks CAP_SYS_RESOURCE (native/criu-limits.c).
.tools/lib/criu-limits.so: native/criu-limits.c .tools/.installed-v3
	mkdir -p .tools/lib
	gcc -shared -fPIC -O2 -Wall -Wextra -o $@ $< -ldl

# Preloaded into the node agent's CRIU: it takes the container's root as `/`
# only after the agent's own loader and libraries are in (native/criu-root.c).
.tools/lib/criu-root.so: native/criu-root.c .tools/.installed-v3
	mkdir -p .tools/lib
	gcc -shared -fPIC -O2 -Wall -Wextra -o $@ $< -ldl

# The OCI runtime wrapper that puts smr-init in front of opted-in containers;
# static, it runs on the host. cJSON's source comes with the tools.
.tools/bin/smr-runtime: services/agent/init/smr-runtime.c .tools/.installed-v3
	gcc -static -Os -Wall -Wextra -I.tools/src/cjson -o $@ $< .tools/src/cjson/cJSON.c

$(STAMP): pyproject.toml
	@# A bare Debian 12 lacks ensurepip until python3-venv is installed.
	python3 -c 'import ensurepip' 2>/dev/null || \
	  (apt-get update -qq && apt-get install -y -qq python3-venv)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: setup
	$(VENV)/bin/smr demo

# The suite, then the `serial` tests alone (they watch or load the whole
# machine); both print their 20 slowest tests. The first run is spread over
# TEST_WORKERS pytest-xdist workers, the longest tests handed out first, and
# the pod tests in TEST_POD_LANES lanes, each lane's tests one after another
# on one worker (tests/helpers/ordering.py). Five workers and three lanes
# take 12-13 minutes on a 2-core machine, where in process takes 42
# (tests/README.md, "In parallel"). make test TEST_WORKERS=0 runs it in process.
TEST_WORKERS ?= 5
TEST_POD_LANES ?= 3
export TEST_POD_LANES
test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder \
	  --durations=20 -m 'not serial'; parallel=$$?; \
	$(PY) -m pytest -q -ra --durations=20 -m serial; serial=$$?; \
	test $$parallel -eq 0 -a \( $$serial -eq 0 -o $$serial -eq 5 \)

bench-storage: setup
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) bench/storage.py

bench-watcher: setup
	$(PY) bench/watcher.py

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/lint-imports && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .tools

# Suspect tests N times under a CPU hog on every core, each test's pass rate:
#   make test-stress FILES='tests/test_gpu_peers.py' N=20
FILES ?=
N     ?= 10
test-stress: setup
	$(PY) scripts/test-stress.py -n $(N) $(FILES)
