"""The frontend DSL: programs of gen, select and fork whose calls share prefixes through the radix cache.

    from radixserve.frontend import function, gen, select, user, assistant, set_default_backend, RuntimeEndpoint

See api.py for the functions, state.py for what a program's `s` offers, choices.py for select's scoring,
dtypes.py for typed generation, runtime.py for launching a server from a script.
"""

from radixserve.frontend.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    get_server_info,
    image,
    select,
    separate_reasoning,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from radixserve.frontend.backends import (Backend, BackendError, EngineBackend, InvalidRequestError,
                                          ModalityNotSupportedError, RuntimeEndpoint)
from radixserve.frontend.chat_template import ChatTemplate
from radixserve.frontend.choices import (
    ChoicesMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixserve.frontend.dtypes import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, REGEX_STRING
from radixserve.frontend.global_config import GlobalConfig, global_config
from radixserve.frontend.program import Program
from radixserve.frontend.runtime import Runtime
from radixserve.frontend.state import ProgramState, ProgramStateGroup

__all__ = [
    "function", "gen", "gen_int", "gen_string", "select", "separate_reasoning", "image", "video", "flush_cache",
    "get_server_info", "global_config", "GlobalConfig", "Runtime", "ModalityNotSupportedError",
    "REGEX_INT", "REGEX_FLOAT", "REGEX_BOOL", "REGEX_STR", "REGEX_STRING",
    "system", "user", "assistant", "system_begin", "system_end", "user_begin",
    "user_end", "assistant_begin", "assistant_end", "set_default_backend", "get_default_backend",
    "Backend", "BackendError", "InvalidRequestError", "EngineBackend", "RuntimeEndpoint", "ChatTemplate",
    "ChoicesMethod", "token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized",
    "Program", "ProgramState", "ProgramStateGroup",
]
