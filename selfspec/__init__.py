"""selfspec: self-speculative decoding from Python.

``selfspec`` is the distribution's name (``pip install selfspec``) and the entry point for people
who want to *use* a method; ``framework`` is the package for people who *write* one (the four
interfaces, the typed objects, the registries), and ``strategies`` holds the built-in methods.

Example:
    >>> import selfspec
    >>> dec = selfspec.Decoder.from_preset("swift", max_new_tokens=64)     # doctest: +SKIP
    >>> out = dec.generate("Explain KV caches in one paragraph.")          # doctest: +SKIP
    >>> out.text, out.stats.mean_accepted_length, out.stats.acceptance_rate  # doctest: +SKIP
    >>> print(dec.compare("Explain KV caches in one paragraph."))          # doctest: +SKIP
"""

from framework.session.presets import list_presets
from framework.session.run_config import RunConfig
from selfspec.decoder import Comparison, Decoder, Generation, GenerationStats

__all__ = ["Comparison", "Decoder", "Generation", "GenerationStats", "RunConfig", "list_presets"]
