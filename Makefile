# The project's own setup: everything a fresh machine needs comes from here.
#   make demo   - set up (first time only) and run the end-to-end demo on storage/
#   make test   - set up (first time only) and run the test suite
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
JARS   := .jars
PYTEST_ARGS ?=

export RMQ_SPARK_JARS := $(abspath $(JARS))

.PHONY: setup demo test lint bench check-back notebooks clean
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
