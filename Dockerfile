# kvindex: one image for every role; the command picks it (see docker-compose.yml).
#   docker build -t kvindex .
#   docker run --rm -p 8000:8000 kvindex kvindex serve --host 0.0.0.0
FROM python:3.11-slim

# No compiler needed: every dependency ships manylinux wheels.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/kvindex
COPY pyproject.toml README.md ./
COPY indexer ./indexer
COPY api ./api
COPY producer ./producer
RUN pip install . && useradd --system --no-create-home kvindex

USER kvindex
# 8000: HTTP API (serve, api); 9100: worker metrics (indexer --metrics-port 9100)
EXPOSE 8000 9100
CMD ["kvindex", "--help"]
