"""The experiment config built from a YAML file and ``key.sub=value`` overrides: unknown keys,
wrong types and values outside a field's declared range or check are refused here, each with a
:class:`ConfigError` naming the key."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml

from megatron_train.config import Check, ExperimentConfig, FilePath, Range
from megatron_train.errors import ConfigError, missing, shown

_INT64_MAX = 2**63 - 1
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _type_name(tp: Any) -> str:
    return _TYPE_NAMES.get(tp) or getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """``value`` checked against annotation ``tp`` (type, then declared range or check); ints are
    accepted where floats are expected. Every field of the schema is checked here and only here."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *declarations = typing.get_args(tp)
        try:
            value = _coerce(value, base, key)
        except ConfigError:
            # An integer past 64 bits that is past the field's range too: the range names the
            # values wanted, where the 64-bit bound would offer one the range refuses.
            if isinstance(value, int) and not isinstance(value, bool):
                _check_ranges(value, declarations, key)
            raise
        _check_ranges(value, declarations, key)
        for rule in declarations:
            if isinstance(rule, Check) and not rule.accepts(value):
                raise ConfigError(key, f"{shown(value)} is not valid", f"set {key} to {rule.describe}")
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError as err:
                errors.append(err)
        # An option of the value's own type that refused it says more than a type mismatch.
        errors.sort(key=lambda err: err.problem.startswith("expected"))
        if len(errors) > 1 and all(_is_mismatch(err) for err in errors):
            forms = ", or ".join(_form(option) for option in options if option is not type(None))
            raise ConfigError(key, f"{shown(value)} is not allowed", f"set {key} to {forms}")
        raise errors[0]
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(key, f"{shown(value)} is not allowed", f"use one of {list(choices)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            fix = "write a YAML list"
            if isinstance(value, str | int | float) and not isinstance(value, bool):
                fix += f": {key}=[{value}] as an override"
            raise ConfigError(key, f"expected a list, got {shown(value)}", fix)
        (item,) = typing.get_args(tp)
        return [_coerce(x, item, key) for x in value]
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key + ".")
    if tp is float:
        return _finite(value, key)
    if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        if tp is int and abs(value) > _INT64_MAX:
            # Counters and sizes go into torch and numpy int64 (and a longer one has more digits
            # than Python turns into text).
            raise ConfigError(
                key, f"{shown(value)} is beyond 64-bit integers", f"set {key} to at most {_INT64_MAX:,}"
            )
        return value
    fix = f"set {key} to {_type_name(tp)}"
    if tp is str and isinstance(value, int | float):
        # A name or path that YAML reads as a number or a truth value (123, 1e3, yes, off).
        leaf = key.rsplit(".", 1)[-1]
        fix = f'quote it to keep it text: {leaf}: "..." in YAML, \'{key}="..."\' as an override ' + (
            "(YAML reads yes, no, on, off, true and false as truth values)"
            if isinstance(value, bool)
            else f"(YAML reads {shown(value)} as a number)"
        )
    raise ConfigError(key, f"expected {_type_name(tp)}, got {type(value).__name__} {shown(value)}", fix)


def _check_ranges(value: float, declarations: list[Any], key: str) -> None:
    for rule in declarations:
        if isinstance(rule, Range) and not rule.allows(value):
            raise ConfigError(
                key, f"{shown(value)} is out of range", f"set {key} to a value {rule.describe()}"
            )


def _is_mismatch(err: ConfigError) -> bool:
    """Whether ``err`` says the value is of the wrong kind, not that its kind's rule refused it."""
    return err.problem.startswith("expected") or err.problem.endswith("is not allowed")


def _form(tp: Any) -> str:
    """What a value of annotation ``tp`` looks like, for a fix that lists a union's options."""
    if typing.get_origin(tp) is Literal:
        return ", ".join(repr(choice) for choice in typing.get_args(tp))
    if typing.get_origin(tp) is Annotated:
        return _form(typing.get_args(tp)[0])
    return _type_name(tp)


def _finite(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(
            key, f"expected a number, got {type(value).__name__} {shown(value)}", f"set {key} to a number"
        )
    try:
        number = float(value)
    except OverflowError:  # an integer beyond the largest float
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(key, f"{shown(value)} is not a finite number", f"set {key} to a finite number")
    return number


def check_fields(cfg: Any, prefix: str = "") -> None:
    """Check every field of a config built in code (not through :func:`from_dict`) against the
    schema's declarations."""
    hints = typing.get_type_hints(type(cfg), include_extras=True)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            check_fields(value, f"{prefix}{f.name}.")
        else:
            _coerce(value, hints[f.name], prefix + f.name)


def _names_paths(hint: Any) -> bool:
    return hint == FilePath or any(_names_paths(arg) for arg in typing.get_args(hint))


def check_paths_written_out(cfg: Any, prefix: str = "") -> None:
    """No path a user wrote starts with ``~`` or holds a ``$VARIABLE``: no shell reads a YAML
    config, so ``~/runs`` would make a folder named ``~`` in the working directory. Checked where
    a config is written (YAML and overrides), not where one is read back from a checkpoint."""
    hints = typing.get_type_hints(type(cfg), include_extras=True)
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            check_paths_written_out(value, key + ".")
        elif _names_paths(hints[f.name]):
            for path in value if isinstance(value, list) else [value]:
                if isinstance(path, str) and (path.startswith("~") or re.search(r"\$\{?\w", path)):
                    here = os.path.expanduser(os.path.expandvars(path))
                    raise ConfigError(
                        key,
                        f"{path!r} holds a ~ or $VARIABLE, which no shell expands in a config",
                        "write the path out in full" + ("" if "$" in here else f" (here: {here})"),
                    )


# Megatron-LM's arguments (``--train-iters`` as ``train_iters``) whose options here have other names;
# one of the same name in another section is found without this table.
MEGATRON_LM_NAMES = {
    "tensor_model_parallel_size": "parallel.tensor",
    "pipeline_model_parallel_size": "parallel.pipeline",
    "num_virtual_stages_per_pipeline_rank": "parallel.virtual_pipeline",
    "context_parallel_size": "parallel.context",
    "expert_model_parallel_size": "parallel.expert",
    "expert_tensor_parallel_size": "parallel.expert_tensor",
    "train_iters": "train.steps",
    "eval_iters": "train.eval_steps",
    "bf16": "train.precision",
    "exit_duration_in_mins": "train.exit_after_minutes",
    "data_path": "data.blend",
    "tokenizer_model": "data.tokenizer.path",
    "tokenizer_type": "data.tokenizer.type",
    "save": "checkpoint.save_dir",
    "save_interval": "checkpoint.interval",
    "lr_decay_style": "optimizer.decay_style",
    "lr_warmup_iters": "optimizer.warmup_steps",
    "lr_decay_iters": "optimizer.decay_steps",
    "lr_wsd_decay_iters": "optimizer.wsd_decay_steps",
    "use_distributed_optimizer": "optimizer.distributed",
    "norm_epsilon": "model.norm_eps",
    "make_vocab_size_divisible_by": "model.vocab_pad_multiple",
    "qk_layernorm": "model.qk_norm",
    "add_qkv_bias": "model.qkv_bias",
    "use_rope_scaling": "model.rope_scaling",
    "recompute_granularity": "model.recompute",
    "cross_entropy_loss_fusion": "model.cross_entropy_fusion",
    "moe_token_dispatcher_type": "model.moe_token_dispatcher",
    "moe_router_enable_expert_bias": "model.moe_router_expert_bias",
    "moe_shared_expert_intermediate_size": "model.moe_shared_expert_ffn_hidden_size",
    "profile_step_start": "profile.start_step",
}


class _UnknownKey(ConfigError):
    """A key ``cls`` has no field for, whose hint the outermost :func:`from_dict` chooses: only it
    knows every section."""

    def __init__(self, prefix: str, name: Any, names: list[str]) -> None:
        self.prefix, self.name, self.names = prefix, str(name), names
        super().__init__(f"{prefix}{name}", "unknown key", f"valid keys: {names}")


def _option_keys(cls: type, prefix: str = "") -> list[str]:
    """Every option of dataclass ``cls`` as its dotted key."""
    keys = []
    for name, tp in typing.get_type_hints(cls).items():
        keys += _option_keys(tp, f"{prefix}{name}.") if dataclasses.is_dataclass(tp) else [prefix + name]
    return keys


def _unknown_key_hint(cls: type, err: _UnknownKey) -> str:
    """What ``err``'s key may have meant: the option Megatron-LM's argument of that name is here,
    the one option of that name in another section, or a near name in its own section."""
    keys = _option_keys(cls)
    name = err.name.replace("-", "_")
    if MEGATRON_LM_NAMES.get(name) in keys:
        return f"Megatron-LM's --{name.replace('_', '-')} is '{MEGATRON_LM_NAMES[name]}' here"
    elsewhere = [key for key in keys if key.rsplit(".", 1)[-1] == name]
    if len(elsewhere) == 1:
        return f"did you mean '{elsewhere[0]}'?"
    close = difflib.get_close_matches(err.name.lower(), err.names, n=1)
    return f"did you mean '{err.prefix}{close[0]}'?" if close else err.fix


def override_for_option(option: str) -> str | None:
    """The config override that a command-line ``option`` the command does not take stands for,
    written out as one (``--train-iters=10`` -> ``train.steps=10``, ``--lr`` ->
    ``optimizer.lr=VALUE``): a dotted key with dashes, an option's own name where no other section
    has one, or Megatron-LM's argument; None for any other."""
    name, given, value = option.lstrip("-").partition("=")
    name = name.replace("-", "_")
    keys = _option_keys(ExperimentConfig)
    found = [key for key in keys if key.rsplit(".", 1)[-1] == name]
    if name in keys:
        key, origin = name, ""
    elif MEGATRON_LM_NAMES.get(name) in keys:
        key, origin = MEGATRON_LM_NAMES[name], f" (Megatron-LM's --{name.replace('_', '-')})"
    elif len(found) == 1:
        key, origin = found[0], ""
    else:
        return None
    return f"{key}={value if given else 'VALUE'}{origin}"


def from_dict(cls: type, data: Any, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a nested dict, rejecting unknown keys and wrong types."""
    try:
        return _from_dict(cls, data, prefix)
    except _UnknownKey as err:
        if prefix:  # an outer from_dict knows more sections
            raise
        raise ConfigError(err.key, err.problem, _unknown_key_hint(cls, err)) from None


def _from_dict(cls: type, data: Any, prefix: str) -> Any:
    key = prefix.rstrip(".") or "<top level>"
    if not isinstance(data, dict):
        raise ConfigError(key, f"expected a mapping, got {shown(data)}", "write key: value pairs")
    hints = typing.get_type_hints(cls, include_extras=True)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for name, value in data.items():
        if name not in names:
            raise _UnknownKey(prefix, name, names)
        kwargs[name] = _coerce(value, hints[name], prefix + name)
    return cls(**kwargs)


_HASH = "\ue000"
"""A private-use character, which no value holds, standing in for ``#`` while an override is parsed."""


def _literal_hashes(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace(_HASH, "#")
    if isinstance(value, list):
        return [_literal_hashes(item) for item in value]
    if isinstance(value, dict):
        return {_literal_hashes(k): _literal_hashes(v) for k, v in value.items()}
    return value


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b=value`` into its key path and YAML-parsed value."""
    key, _, raw = text.partition("=")
    # An empty name ("=5", "model..x=1") would be reported as an unknown key ''.
    if "=" not in text or not all(part.strip() for part in key.split(".")):
        raise ConfigError(text, "override is not of the form key.sub=value", "write key=value")
    try:
        # The shell takes comments off a command line: a "#" that reaches an override was quoted
        # and is part of the value, where YAML would drop the rest as a comment
        # (logging.run_dir='runs/a #2' trained in runs/a, another run's folder).
        value = yaml.load(raw.replace("#", _HASH), Loader=_ConfigLoader) if raw != "" else None  # noqa: S506
        value = _literal_hashes(value)
    except yaml.YAMLError as err:
        if raw.lstrip()[:1] in ("'", '"', "[", "{"):
            # Taken as text, a quote left open named a folder '"runs'.
            problem = getattr(err, "problem", None) or getattr(err, "context", None) or "not valid YAML"
            raise ConfigError(
                key.strip(),
                f"{shown(raw)} starts a quoted or bracketed value that is not valid YAML ({problem})",
                "close the quote or bracket, with nothing after it",
            ) from None
        value = raw
    except RecursionError:
        raise ConfigError(key.strip(), "the value nests lists or mappings too deeply", "flatten it") from None
    return key.strip().split("."), value


class _ConfigLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one,
    so a second ``model:`` section would silently replace the first), and reading an exponent
    without a dot (``1e-3``) as the number YAML 1.2 reads, not as the text YAML 1.1 does: as
    text, a blend's ``[1e-3, a, 1, b]`` would be read as a dataset named ``1e-3``."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = []
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *anchor`` may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice", key_node.start_mark
                )
            seen.append(key)
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        digits = node.value.replace("_", "")
        if re.fullmatch(r"[-+]?0[0-9]+", digits):
            # A leading zero is YAML 1.1's octal (train.seed=0042 was 34); YAML 1.2 reads decimal.
            return int(digits, 10)
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            # Python reads at most sys.get_int_max_str_digits() digits into an int.
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {len(node.value):,} characters, too long to read", node.start_mark
            ) from None


_ConfigLoader.add_constructor("tag:yaml.org,2002:int", _ConfigLoader.construct_yaml_int)
# No option is a date: a run named 2024-06-01 is text, not the date YAML 1.1 would read.
_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# 08 and 09, which YAML 1.1 reads as text for not being octal, are numbers like 07.
_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?0[0-9_]+$"), list("-+0"))
_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def read_yaml(path: str | Path) -> dict:
    """A YAML config file as plain data."""
    path = Path(path)
    if path.is_dir() or not path.exists():
        problem = "is a directory" if path.is_dir() else missing(path)
        raise ConfigError("--config", f"{str(path)!r} {problem}", "pass an existing YAML file")
    if not path.is_file():
        # Every rank reads the config: a pipe (bash's <(...)) would give it to one rank only.
        raise ConfigError(
            "--config",
            f"{str(path)!r} is not a regular file (a device or a pipe, which one rank alone could read)",
            "write the config to a file and pass its path",
        )
    try:
        # Bytes: PyYAML then finds a UTF-16 file's encoding (Windows PowerShell's ">" writes it)
        # from its byte-order mark.
        raw = yaml.load(path.read_bytes(), Loader=_ConfigLoader)  # noqa: S506 - a SafeLoader
    except yaml.reader.ReaderError as err:
        raise ConfigError(
            "--config",
            f"{path} cannot be read as text ({err.reason}, byte {err.position})",
            "save it as UTF-8 text",
        ) from err
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(
            "--config", f"{path} is not valid YAML{where}: {problem}", "fix the YAML syntax"
        ) from err
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(
            "--config", f"{path} cannot be read as text ({err})", "pass a readable YAML file"
        ) from err
    except RecursionError:
        # PyYAML builds nested lists and mappings recursively.
        raise ConfigError(
            "--config", f"{path} nests lists or mappings too deeply to be read", "flatten them"
        ) from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(
            "--config",
            f"{path} holds a {type(raw).__name__}, not a mapping of sections",
            "write section: {key: value}",
        )
    return raw


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """``raw`` with ``key.sub=value`` overrides applied in order (changed in place)."""
    for text in overrides:
        keys, value = parse_override(text)
        node = raw
        for depth, part in enumerate(keys[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                dotted = ".".join(keys[: depth + 1])
                if dotted in _option_keys(ExperimentConfig):
                    problem, fix = "is an option, not a section of options", f"write {dotted}=VALUE"
                else:
                    problem, fix = f"is {shown(child)}, not a section", "write it as key: value pairs"
                raise ConfigError(dotted, problem, fix)
            node = child
        node[keys[-1]] = value
    return raw
