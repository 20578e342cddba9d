# The worker image of docker-compose.yml: streamtally with its compiled hot path.
#
# The build stage has a C compiler: it installs the project from /app (editable, as `make
# setup` does; mypy cannot analyse the package from site-packages, where the libraries
# beside it shadow the standard ones) with mypy, whose mypyc compiles, and setuptools, and
# runs `streamtally native build`, which puts the compiled modules beside the sources
# (/app/streamtally/.native/, with the manifest of this Python and of these sources).  The
# runtime stage takes /app and the virtualenv as they are, on the same base image (same
# Python, same paths), without the compiler, and checks that the compiled modules are in
# use (`streamtally native status` exits 3 if not).
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . .
RUN python -m venv /opt/streamtally \
    && /opt/streamtally/bin/pip install --no-cache-dir --disable-pip-version-check \
        -e . "mypy>=1.13" "setuptools>=65" \
    && /opt/streamtally/bin/streamtally native build

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/streamtally /opt/streamtally
COPY --from=build /app /app
WORKDIR /app
ENV PATH=/opt/streamtally/bin:$PATH \
    PYTHONUNBUFFERED=1
RUN streamtally native status
CMD ["streamtally", "worker"]
