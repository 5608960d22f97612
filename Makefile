# The project's own setup: everything a fresh machine needs comes from here.
#   make demo   - set up (first time only) and run the end-to-end demo on storage/
#   make test   - set up (first time only) and run the test suite
#   make torture SEED=42 MINUTES=10 PRODUCERS=4 SHARDS=4 S3_DELAY_MS=20 - the torture test, on
#                   demand (SEED: default a new one; SHARDS: the store's shards, default 1;
#                   S3_DELAY_MS: the store on s3://, MinIO behind a delay)
#   make objectstore - what the object-store and cluster tests add (make test runs it)
#   make browser  - Debian's chromium for the browser tests of rmqtx ui (make test runs it)
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
JARS   := .jars
PYTEST_ARGS ?=

export RMQ_SPARK_JARS := $(abspath $(JARS))

# The object-store tier: MinIO built from the Go module proxy (a pinned pseudo-version: MinIO's
# tags are not semver) and Spark's S3A jars. Both are large, so they are cached per user:
# Go's own module and build caches (a rebuild takes seconds), and a Maven repository under
# $(CACHE). A fresh machine fetches everything; nothing outside these files is relied upon.
TOOLS         := .tools
MINIO_VERSION := v0.0.0-20260212201848-7aac2a2c5b7c
CACHE         ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/rmq-spark
export RMQ_SPARK_MINIO := $(abspath $(TOOLS))/bin/minio

.PHONY: setup objectstore browser demo test torture lint bench bench-objectstore bench-scale bench-requests bench-peers bench-serve bench-consumers java-client-example check-back notebooks notebook-outputs clean
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

objectstore: setup $(TOOLS)/bin/minio $(JARS)/s3/.fetched

$(TOOLS)/bin/minio:
	@command -v go >/dev/null || { echo "make objectstore needs Go (https://go.dev/dl/)" >&2; exit 1; }
	@echo "building MinIO $(MINIO_VERSION) (minutes the first time; cached by Go after)"
	GOBIN=$(abspath $(TOOLS))/bin GOFLAGS=-buildvcs=false go install github.com/minio/minio@$(MINIO_VERSION)

$(JARS)/s3/.fetched: jars/s3/pom.xml
	mkdir -p $(JARS)/s3
	mvn --batch-mode --quiet -f jars/s3/pom.xml -Dmaven.repo.local=$(CACHE)/m2 \
	    dependency:copy-dependencies -DexcludeTransitive=true \
	    -DoutputDirectory=$(abspath $(JARS))/s3
	touch $@

demo: setup
	$(PY) jobs/demo.py

# Headless Chromium for the browser tests of rmqtx ui: Debian's package (as root, or with
# sudo); Playwright, from the test extra, drives it.
CHROMIUM := /usr/bin/chromium
browser:
	@test -x $(CHROMIUM) || { \
	    if [ "$$(id -u)" -eq 0 ]; then SUDO=; else SUDO=sudo; fi; \
	    echo "installing Debian's chromium for the browser tests"; \
	    $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium \
	    || { $$SUDO apt-get update -q && $$SUDO env DEBIAN_FRONTEND=noninteractive \
	         apt-get install -y --no-install-recommends chromium; }; }

# pytest exits 5 when it collects no test; that is not a failure of the suite.
# The object-store, cluster and browser tiers run too: here a missing MinIO or Chromium is an
# error, not a skip.
test: objectstore browser
	RMQ_SPARK_OBJECTSTORE=required RMQ_SPARK_GO=required RMQ_SPARK_BROWSER=required $(PY) -m pytest $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The torture test on demand: producers, sinks, publish_with_delta_write, check-back jobs,
# resumes and compaction in real processes, SIGKILLed at random; then check-back to quiescence
# and the exactly-once invariants. Prints a report; exits 1 on a violation. Replay a run with
# its SEED. (The suite runs a short one: pytest -m torture.)
SEED    ?=
MINUTES ?= 10
torture: setup $(if $(S3_DELAY_MS),objectstore)
	$(PY) -m tests.torture.run $(if $(SEED),--seed $(SEED)) --minutes $(MINUTES) $(if $(PRODUCERS),--producers $(PRODUCERS)) $(if $(SHARDS),--shards $(SHARDS)) $(if $(S3_DELAY_MS),--s3-delay-ms $(S3_DELAY_MS))

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

# Run the notebooks and store them with their outputs (the suite checks that they are current).
notebook-outputs: setup
	$(PY) -m tests.notebook_outputs

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup
	$(PY) bench/run_all.py

# N producer processes on one s3:// store behind a proxy that adds an object store's round trip
# (MinIO from make objectstore), e.g. make bench-scale ARGS="--runs 1x4,16x4 --delay-ms 30".
bench-scale: objectstore
	$(PY) bench/scale_bench.py $(ARGS)

# Every request one transaction costs an s3:// store (MinIO behind a counting proxy), beside a
# plain deltalake append of one row, e.g. make bench-requests ARGS="--transactions 500".
bench-requests: objectstore
	$(PY) bench/requests_bench.py $(ARGS)

# rmq-spark beside a RocketMQ broker and Spark's Kafka connector, in one run (the peers come
# from ../shared/anchors when present; each fetches its own jars from Maven Central).
bench-peers: setup
	$(PY) bench/side_by_side.py

# The official RocketMQ 5 Java client's transactional producer against rmqtx serve and against
# RocketMQ 5.5.0's gRPC proxy (local mode), in one run (jars from Maven Central; needs a JDK).
bench-serve: setup
	$(PY) bench/java_client_bench.py $(ARGS)

# The official Python client's SimpleConsumers against rmqtx serve and RocketMQ 5.5.0's gRPC
# proxy (local mode), in one run: messages received and acked a second, commit to receive.
bench-consumers: setup
	$(PY) bench/consumer_bench.py $(ARGS)

# The official Java client's transactional-producer example, unchanged but for the endpoint,
# against rmqtx serve; passes when its message is read once with format("rmqtx") (on demand).
java-client-example: setup
	$(PY) bench/java_client_example.py

# The sink and source benchmarks on local disk and on an S3 root (MinIO), side by side.
bench-objectstore: objectstore
	$(PY) bench/source_bench.py --s3
	$(PY) bench/sink_bench.py --s3

clean:
	rm -rf $(VENV) $(JARS) $(TOOLS) storage/*/ *.egg-info
