"""The demo: a small GPT-style transformer, a synthetic language of exactly known entropy,
and the runner behind ``gradientmail demo`` (``runner``, ``worker``, ``view``, ``settings``).

``GPT``/``GPTConfig`` (``model``) and ``MarkovSource``, ``synthetic``, ``text_file``,
``evaluate`` (``data``) are also what the benchmarks train and measure with.
"""

from gradientmail.demo.data import Corpus, MarkovSource, evaluate, synthetic, text_file
from gradientmail.demo.model import GPT, GPTConfig

__all__ = ["GPT", "Corpus", "GPTConfig", "MarkovSource", "evaluate", "synthetic", "text_file"]
