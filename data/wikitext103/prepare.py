"""WikiText-103 (Merity et al. 2016), the ALiBi paper's corpus, raw text with GPT-2 BPE (~120M train
tokens). The rows are lines of articles, joined as they are; an end-of-text token goes before each
article's title line (" = Title = ", one "=" a side; sections have more), so that the articles are
documents for packing="documents".
    python data/wikitext103/prepare.py [--num_proc 8]
"""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lib.datafiles import hf_recipe, run_hf_recipe  # noqa: E402


def split(dataset):
    return {"train": dataset["train"], "val": dataset["validation"]}


ARTICLE_TITLE = re.compile(r"^ = [^=].* = \n?$")


def begins_article(line: str) -> bool:
    return bool(ARTICLE_TITLE.match(line))


prepare = hf_recipe(Path(__file__).resolve().parent, split, eot=begins_article)

if __name__ == "__main__":
    run_hf_recipe(
        __doc__,
        prepare,
        lambda load_dataset, num_proc: load_dataset("wikitext", "wikitext-103-raw-v1"),
    )
