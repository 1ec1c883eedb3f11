"""Model profiles: a real model's tokenizer and its real formats, verified at load.

A profile is what makes rebuilt token ids trustworthy. It names the model it stands for,
loads that model's vocabulary, and declares the model's formats as facts (sources in
``docs/fidelity.md`` and ``../shared/reference``):

- the special tokens with the ids the model's own tokenizer files give them; at load every
  one is encoded and the profile refuses to start when one lands elsewhere (a DeepSeek-V4
  vocabulary under an R1 profile names the expected and the found ids);
- the prompt format: a chat template (the user's, else the model folder's, else ours,
  conformance-tested against the official one) and the template kwargs it is rendered with;
- where the think-start lives: in the generation prompt (``prompt``: R1, Qwen3-2507,
  V3.1/V4 thinking), emitted by the model itself (``model``: Qwen3 hybrid, Kimi-K2-Thinking)
  or nowhere (the model does not think); whether thinking can be switched off, and how;
- the native tool-call format of structured calls;
- which ids are control tokens (declared tokens, special-flagged added tokens and the
  template's markers). Ordinary added tokens (Gemma's newline runs) are text.

Built in, named after the models: ``qwen3`` (the default), ``qwen3-thinking-2507``,
``deepseek-r1``, ``deepseek-v3.1``, ``deepseek-v3``, ``deepseek-v4``, ``kimi-k2``,
``kimi-k2-thinking``, ``kimi-k2.5``. Users add their own as ``[profiles.<name>]``.

This package re-exports its modules' public names: ``spec`` (the declarations), ``catalogue``
(the built-ins), ``profile`` (a loaded profile), ``toolcalls`` (native tool-call text),
``loading`` (by name, one cache) and ``protocol`` (the face the stages type against).
"""

from services.profiles.catalogue import (
    BUILTIN_PROFILES,
    BUILTIN_SPECS,
    DEFAULT_PROFILE,
    KIMI_PAT_STR,
    QWEN3_NOT_SPECIAL,
    QWEN3_SPECIAL_START,
    QWEN3_SPECIALS,
    QWEN_PAT_STR,
)
from services.profiles.loading import known_profiles, load_profile, profile_spec
from services.profiles.profile import Profile, profile_from_backend
from services.profiles.protocol import ProfileLike
from services.profiles.spec import TOOL_FORMATS, ProfileError, ProfileSpec, PromptState, ThinkLocation
from services.profiles.toolcalls import DSML, GAP_ARGUMENTS, GAP_BETWEEN, Piece

__all__ = [
    "BUILTIN_PROFILES",
    "BUILTIN_SPECS",
    "DEFAULT_PROFILE",
    "DSML",
    "GAP_ARGUMENTS",
    "GAP_BETWEEN",
    "KIMI_PAT_STR",
    "QWEN3_NOT_SPECIAL",
    "QWEN3_SPECIALS",
    "QWEN3_SPECIAL_START",
    "QWEN_PAT_STR",
    "TOOL_FORMATS",
    "Piece",
    "Profile",
    "ProfileError",
    "ProfileLike",
    "ProfileSpec",
    "PromptState",
    "ThinkLocation",
    "known_profiles",
    "load_profile",
    "profile_from_backend",
    "profile_spec",
]
