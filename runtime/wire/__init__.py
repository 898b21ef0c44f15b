"""The wire: what every process of radixserve shares, and nothing else.

- `request`: `GenerateRequest`, the one request every surface decodes into, and `normalize`, which decides once
  what follows from it (batch shape, n expansion, sampling parameters, the cache namespace);
- `request_body`: native /generate's JSON body as a GenerateRequest;
- `compat`: SGLang's and vLLM's request fields radixserve does not implement, and the one rule for accepting them;
- `messages`: every message that crosses a process boundary (tagged msgspec Structs, one `Message` union);
- `sampling_params`: `SamplingParams`, the one validator of a request's sampling parameters and its length rule;
- `server_args`: `ServerArgs`, the one typed configuration object;
- `ipc`: the ZMQ socket paths and helpers;
- `errors`: the exceptions callers see (typed, so the HTTP layer maps each onto a status);
- `grammar_check`: early validation of structured-output grammars.

These modules are light (no torch, no FastAPI) and import none of the components, so the TokenizerManager,
the scheduler and the detokenizer all import them and nothing of each other.
"""
