# make demo: train the RoPE model on the embedded Shakespeare and print a sample (GPU if there is one, else CPU).
# make test: the whole test suite. Both create .venv and install requirements.txt on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

demo: $(VENV)/.installed
	@if [ -f out-rope/ckpt.pt ]; then \
		echo "out-rope already holds a trained model: sampling it (rm -r out-rope to train again)"; \
	elif $(PY) -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then \
		$(PY) train.py config/rope.py; \
	else \
		echo "no GPU: training the CPU-sized model (config/rope.py config/cpu.py)"; \
		$(PY) train.py config/rope.py config/cpu.py; \
	fi
	$(PY) sample.py --out_dir=out-rope --num_samples=1 --max_new_tokens=500

test: $(VENV)/.installed
	$(PY) -m pytest -n auto --dist worksteal

lint: $(VENV)/.installed
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .
