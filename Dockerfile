# One image for every LlamaFleet process; docker-compose.yml picks the command.
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY requirements.txt pyproject.toml ./
COPY scripts/install_engine.sh scripts/check_engine.py scripts/
RUN pip install --no-cache-dir -r requirements.txt && scripts/install_engine.sh python
COPY . .
RUN pip install --no-cache-dir --no-deps -e .
ENV PYTHONUNBUFFERED=1 LLAMAFLEET_VAR_DIR=/data
