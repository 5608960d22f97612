# The project's own setup: everything a fresh machine needs comes from here.
#   make demo   - set up (first time only) and run the end-to-end demo on storage/
#   make test   - set up (first time only) and run the test suite
#   make torture SEED=42 MINUTES=10 - the torture test, on demand (SEED: default a new one)
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
JARS   := .jars
PYTEST_ARGS ?=

export RMQ_SPARK_JARS := $(abspath $(JARS))

.PHONY: setup demo test torture lint bench check-back notebooks clean
setup: $(VENV)/.installed $(JARS)/.fetched

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

$(JARS)/.fetched: jars/pom.xml
	mkdir -p $(JARS)
	mvn --batch-mode --quiet -f jars/pom.xml \
	    -Dmaven.repo.local=$(abspath $(JARS))/.m2 \
	    dependency:copy-dependencies -DexcludeTransitive=true \
	    -DoutputDirectory=$(abspath $(JARS))
	touch $@

demo: setup
	$(PY) jobs/demo.py

# pytest exits 5 when it collects no test; that is not a failure of the suite.
test: setup
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The torture test on demand: producers, sinks, publish_with_delta_write, check-back jobs,
# resumes and compaction in real processes, SIGKILLed at random; then check-back to quiescence
# and the exactly-once invariants. Prints a report; exits 1 on a violation. Replay a run with
# its SEED. (The suite runs a short one: pytest -m torture.)
SEED    ?=
MINUTES ?= 10
torture: setup
	$(PY) -m tests.torture.run $(if $(SEED),--seed $(SEED)) --minutes $(MINUTES)

# The check-back job through spark-submit, e.g. make check-back ARGS="--once".
check-back: setup
	PATH="$(abspath $(VENV))/bin:$$PATH" spark-submit \
	    --jars $$(ls $(JARS)/delta-spark_*.jar $(JARS)/delta-storage-*.jar | paste -sd, -) \
	    --driver-java-options -Dlog4j2.configurationFile=file:$(abspath rmq_spark/log4j2.properties) \
	    jobs/check_back.py $(ARGS)

# JupyterLab on notebooks/ (installs the 'notebooks' extra the first time).
notebooks: setup
	$(PY) -m pip install --quiet -e '.[notebooks]'
	$(VENV)/bin/jupyter lab notebooks/

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) $(JARS) storage/*/ *.egg-info
