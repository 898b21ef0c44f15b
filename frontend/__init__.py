"""The frontend DSL: programs of gen, select and fork whose calls share prefixes through the radix cache.

    from radixserve.frontend import function, gen, select, user, assistant, set_default_backend, RuntimeEndpoint

See api.py for the functions, state.py for what a program's `s` offers, and choices.py for select's scoring.
"""

from radixserve.frontend.api import (
    assistant,
    assistant_begin,
    assistant_end,
    function,
    gen,
    get_default_backend,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from radixserve.frontend.backends import Backend, BackendError, EngineBackend, InvalidRequestError, RuntimeEndpoint
from radixserve.frontend.chat_template import ChatTemplate
from radixserve.frontend.choices import (
    ChoicesMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixserve.frontend.program import Program
from radixserve.frontend.state import ProgramState, ProgramStateGroup

__all__ = [
    "function", "gen", "select", "system", "user", "assistant", "system_begin", "system_end", "user_begin",
    "user_end", "assistant_begin", "assistant_end", "set_default_backend", "get_default_backend",
    "Backend", "BackendError", "InvalidRequestError", "EngineBackend", "RuntimeEndpoint", "ChatTemplate",
    "ChoicesMethod", "token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized",
    "Program", "ProgramState", "ProgramStateGroup",
]
