# The two commands of the README: `make run` and `make test`. Everything else supports them.
VENV ?= .venv
PY := $(VENV)/bin/python
PROTO := proto/llamafleet/agent/v1/agent.proto

.PHONY: setup run stop status test lint proto check-proto superuser engine-rebuild clean bench bench-gemma bench-split bench-planner bench-grammar bench-batching bench-save-ahead bench-hop bench-cores bench-soak bench-fleet bench-coldstart bench-console llama-server nginx

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml scripts/install_engine.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	scripts/install_engine.sh $(PY)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

run: setup
	$(PY) scripts/stack.py up

stop:
	$(PY) scripts/stack.py down

status:
	$(PY) scripts/stack.py status

test: setup
	scripts/test.sh $(PY)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

proto: setup
	$(PY) -m grpc_tools.protoc -Iproto --python_out=proto --grpc_python_out=proto --pyi_out=proto $(PROTO)

check-proto: setup
	scripts/check_proto.sh $(PY)

# The serving benchmark compares with llama.cpp's own llama-server, built once under var/,
# and for two replicas with two llama-servers behind nginx's least_conn (Debian's nginx-light,
# installed as root; without it that comparison is skipped with a message).
llama-server: setup
	scripts/build_llama_server.sh $(PY)

nginx:
	@command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || [ "$$(id -u)" != 0 ] \
	  || DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx-light >/dev/null || true

bench: llama-server nginx
	$(PY) bench/serving.py

bench-gemma: llama-server nginx
	$(PY) bench/serving.py --model gemma

# Needs root (network namespaces) and the test model cache (run `make test` once).
bench-split: setup
	$(PY) bench/split.py

bench-planner: setup
	$(PY) bench/planner.py

# The control plane with 1,000 simulated agents (PostgreSQL and Redis; the test model cache).
bench-fleet: setup
	$(PY) bench/fleet.py

# Time to first token from zero replicas (needs the test model cache).
bench-coldstart: setup
	$(PY) bench/coldstart.py

# Needs the test model cache (run `make test` once).
bench-grammar: setup
	$(PY) bench/grammar.py

# The batch-invariant mode's cost in the engine alone (needs the test model cache).
bench-batching: setup
	$(PY) bench/batching.py

# A conversation's copy to host RAM made while idle, against one made when a request
# pushes it out (the engine alone; needs the test model cache).
bench-save-ahead: setup
	$(PY) bench/save_ahead.py

bench-hop: setup
	$(PY) bench/hop.py

# Two replicas on one agent: threads shared among busy engines against fixed counts.
bench-cores: llama-server
	$(PY) bench/cores.py

# Database queries of 10 open consoles, idle and with the fleet changing (PostgreSQL with
# DATABASE_URL, else SQLite).
bench-console: setup
	$(PY) bench/console.py

# 64 clients for 10 minutes against a fresh bench stack: no 5xx, 429 with Retry-After, flat memory.
bench-soak: setup
	$(PY) bench/soak.py

superuser: setup
	$(PY) manage.py createsuperuser

engine-rebuild: setup
	CMAKE_ARGS="-DGGML_RPC=ON -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
	  $(PY) -m pip install --force-reinstall --no-cache-dir --no-binary llama-cpp-python --no-deps llama-cpp-python==0.3.36

clean: stop
	rm -rf var
