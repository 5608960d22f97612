"""The check-back job as a spark-submit entry point (same code as `rmqtx check`).

    spark-submit --jars .jars/delta-spark_4.2_2.13-4.4.0.jar,.jars/delta-storage-4.4.0.jar \\
        --master spark://host:7077 jobs/check_back.py --once [--checker GROUP=MODULE:FUNCTION ...]

Options are those of `rmqtx check --help`; `--conf` and `--path` go first.
"""

from __future__ import annotations

import sys

from rmq_spark.ops.cli import main

if __name__ == "__main__":
    options = sys.argv[1:]
    global_options = []
    while options[:1] and options[0] in ("--conf", "--path"):
        global_options += options[:2]
        options = options[2:]
    sys.exit(main([*global_options, "check", *options]))
