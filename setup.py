"""rmq-spark: RocketMQ-style transactional messages on Spark and Delta Lake."""

from pathlib import Path

from setuptools import find_packages, setup

version = {}
exec((Path(__file__).parent / "rmq_spark" / "_version.py").read_text(), version)

setup(
    name="rmq-spark",
    version=version["__version__"],
    description="RocketMQ-style transactional messaging (half messages, op records, "
    "check-back) on Spark and Delta Lake, with no broker.",
    long_description=(Path(__file__).parent / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["rmq_spark", "rmq_spark.*"]),
    package_data={
        "rmq_spark": ["py.typed", "log4j2.properties"],
        # rmqtx ui's pages, and uPlot (MIT, vendor/uPlot.LICENSE) for their charts.
        "rmq_spark.ops.ui": ["static/*.*", "static/vendor/*"],
    },
    install_requires=[
        "pyspark==4.2.0",
        "delta-spark==4.4.1",
        "deltalake==1.6.6",
        "pyarrow>=17",
        "pandas>=2.2,<3",  # pyspark 4.2 warns it does not fully support pandas 3
        "fsspec>=2024.6",
        "numpy>=1.26",
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "ruff>=0.6",
            # The notebooks are executed by the test suite.
            "nbclient>=0.10",
            "nbformat>=5.10",
            "ipykernel>=6.29",
            "matplotlib>=3.8",
            # The object-store tier's s3:// roots (MinIO).
            "s3fs>=2024.6",
            # rmqtx serve and its tests (the official RocketMQ 5 client).
            "rocketmq-python-client==5.1.2",
            "grpcio>=1.60",
            "cryptography>=42",
            # rmqtx ui's pages in headless Chromium (Debian's, from make browser).
            "playwright==1.65.2",
        ],
        # rmqtx serve: RocketMQ 5's gRPC protocol (the client's stubs) in front of a store;
        # cryptography makes its self-signed certificate when TLS is on and none is given.
        "serve": ["rocketmq-python-client==5.1.2", "grpcio>=1.60", "cryptography>=42"],
        "notebooks": ["jupyterlab>=4", "matplotlib>=3.8"],
        # Object-storage store roots (fsspec filesystems); see rmq_spark/delta/storage.py.
        "s3": ["s3fs>=2024.6"],
        "gcs": ["gcsfs>=2024.6"],
        "adls": ["adlfs>=2024.4"],
    },
    entry_points={"console_scripts": ["rmqtx=rmq_spark.ops.cli:main"]},
)
