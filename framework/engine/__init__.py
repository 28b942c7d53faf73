"""The engine: the model adapter, the KV cache, the decode state, the decoding loops, drafting
helpers and the cost model. It imports the API (`framework.interfaces`, `framework.types`) and
the kernels, never tooling (`framework.runner`, `framework.benchmark`, ...) or `strategies`."""
