# kvindex: one image for every role; the command picks it (see docker-compose.yml).
#   docker build -t kvindex .
#   docker run --rm -p 8000:8000 kvindex kvindex serve --host 0.0.0.0
#
# Two stages: the full Python image has the C compiler and OpenSSL headers the
# compiled core (Cython) builds with, plus xxhash's header (compiled in); the
# slim runtime image gets only the installed environment (its libcrypto is the
# one the core links against).
FROM python:3.11-bookworm AS build

RUN apt-get update && apt-get install -y --no-install-recommends libxxhash-dev \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

WORKDIR /opt/kvindex
RUN python -m venv /opt/venv
# What kvindex runs with, exact versions and hashes (make lock refreshes it); kvindex builds
# with the lock's setuptools and Cython.
COPY locks/service.txt ./locks/
RUN pip install --require-hashes --no-deps -r locks/service.txt
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY indexer ./indexer
COPY api ./api
COPY producer ./producer
COPY kvindex ./kvindex
COPY answers ./answers
# The build fails here, not at run time, if the compiled core did not build.
RUN pip install --no-deps --no-build-isolation . && pip check \
    && cd / && python -c "from api.operators import compiled_status as s; assert s()['compiled_core'], s()"

FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH

COPY --from=build /opt/venv /opt/venv
RUN useradd --system --no-create-home kvindex

USER kvindex
# 8000: HTTP API (serve, api); 9100: worker metrics (indexer --metrics-port 9100)
EXPOSE 8000 9100
CMD ["kvindex", "--help"]
