"""A run as a Hugging Face transformers folder: python -m export <out_dir> --out <folder>
(export/hf.py)."""
