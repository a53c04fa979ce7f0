"""The option table: every option of `brisk serve`, `LLM(...)` and the YAML files, declared once.

An option is a field of one of the option models (brisk/config.py's `EngineConfig`: the engine, `LLM(...)` and
`brisk serve`; brisk/server_config.py's `ServerConfig`: `brisk serve` only; brisk/config.py's `OptionFiles`: the
YAML files; groups of them such as brisk/kv_cache/config.py's `KvCacheConfig` and brisk/option_groups.py's
`MoeConfig`), each an `OptionModel`, declared with `option(...)`:
the field's annotation is its type, and `option` holds its default, range, one line of help, and its other
spellings (trtllm's and vLLM's flags and YAML keys). A nested model (kv_cache_config) is a group of options with
dotted paths. Everything else comes from these declarations, through `OptionTable`:

- `rows`                      the table, one `OptionRow` per option
- `add_arguments(parser)`     the argparse flags (`brisk serve --help`)
- `resolve(given, source)`    YAML keys, `LLM(**kwargs)` or parsed flags -> each model's keyword dict, every
                              spelling mapped to its option; an unknown key fails naming it, with a "did you mean"
- `markdown()`                docs/options.md (tests/test_options.py checks the file matches)

Every spelling works both as a flag (`--max-num-seqs`, `--max_num_seqs`) and as a YAML key or keyword
(`max-num-seqs:`, `max_num_seqs:`): vLLM's `--config` YAML holds flags by name, trtllm's YAML holds keys. A dotted
spelling (trtllm="kv_cache_config.dtype") is the option's own path in its group, listed in the docs only.

Adding an option: one field in the model it belongs to, e.g. in KvCacheConfig

    host_cache_size: int = option(0, "bytes of host memory for KV blocks evicted from the GPU", ge=0,
                                  trtllm="kv_cache_config.host_cache_size")

(a top-level field gets its flag `--name`; a field of a group gets flags only through its spellings); where vLLM's
word means the same, vllm="..." adds its flag and key; where it means something else or counts in other units (vLLM's
--kv-offloading-size, GiB), it is an option of its own, converted where the config is built (as
gpu_memory_utilization is in EngineConfig.on_device). Then a test of its effect named in tests/test_options.py's
OPTION_TESTS, and `tools/options_doc.py` to regenerate docs/options.md.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


class OptionModel(BaseModel):
    """The base of the option models: unknown keys are errors, assignments validated."""

    model_config = ConfigDict(extra="forbid", strict=False, validate_assignment=True)


class OptionError(ValueError):
    """A key or value given for an option is wrong; the message names it (config.py raises it as ConfigError)."""


_UNSET: Any = object()


@dataclass(frozen=True)
class Alias:
    """Another spelling of an option (a flag `--NAME` and a key `NAME:`), and how its value maps onto the option.

    invert: a bool option spelled the other way round (vLLM's async_scheduling = not disable_overlap_scheduler).
    sets: a switch: `when` (true, unless given) sets the option to this value, the other leaves it alone
    (enforce_eager: true sets cuda_graph_config to null; trtllm's use_cuda_graph: false does).
    A dotted name is a spelling inside the option's group (cuda_graph_config.padding_enabled), unless it is the
    option's own path (listed in the docs only)."""

    name: str
    invert: bool = False
    sets: Any = _UNSET
    when: bool = True

    def apply(self, value: Any) -> Any:
        """The option's value for this spelling's `value`; _UNSET when it leaves the option alone."""
        if not self.invert and self.sets is _UNSET:
            return value
        if not isinstance(value, bool):
            raise OptionError(f"option '{self.name}' is a switch: give true or false (got {value!r})")
        if self.invert:
            return not value
        return self.sets if value is self.when else _UNSET

    @property
    def is_switch(self) -> bool:
        return self.sets is not _UNSET


Spelling = str | Alias


@dataclass(frozen=True)
class Spellings:
    """What `option()` attaches to a field besides pydantic's own type, default and range."""

    help: str
    trtllm: tuple[Alias, ...] = ()
    vllm: tuple[Alias, ...] = ()
    aliases: tuple[Alias, ...] = ()  # brisk's other spellings
    short: tuple[str, ...] = ()  # short flags (-tp)
    flag: bool = True  # a top-level option has a flag `--name` of its own; a nested one only through its aliases
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # a flag's text to its value (default: from the type)
    nargs: str | None = None
    # accepted for a peer's configs, doing nothing in brisk: the help says why, and giving it logs that at start-up
    no_effect: bool = False


def _aliases(items: Spelling | Sequence[Spelling]) -> tuple[Alias, ...]:
    if isinstance(items, (str, Alias)):
        items = (items,)
    return tuple(item if isinstance(item, Alias) else Alias(item) for item in items)


def option(
    default: Any = PydanticUndefined,
    help: str = "",
    *,
    trtllm: Spelling | Sequence[Spelling] = (),
    vllm: Spelling | Sequence[Spelling] = (),
    aliases: Spelling | Sequence[Spelling] = (),
    short: Sequence[str] = (),
    flag: bool = True,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    nargs: str | None = None,
    default_factory: Callable[[], Any] | None = None,
    no_effect: bool = False,
    **constraints: Any,
) -> Any:
    """A config field that is an option: pydantic's Field (default, ge/gt/le/lt...) with its spellings and help.

    trtllm / vllm: how TensorRT-LLM and vLLM spell the same option, where that is not its own name (each works as a
    flag and as a key, and docs/options.md lists them); aliases: brisk's further spellings. no_effect: a peer's
    option that means nothing in brisk, accepted so that the peer's configs load: `help` says why (the docs show
    it as "no effect: ..."), and a config that gives it logs that line at start-up (`no_effect_notes`)."""
    if not help:
        raise ValueError("an option needs one line of help")
    if no_effect:
        help = f"no effect: {help}"
    if default_factory is not None:
        info = FieldInfo(default_factory=default_factory, description=help, **constraints)
    else:
        info = FieldInfo(default=default, description=help, **constraints)
    info.metadata.append(
        Spellings(
            help,
            _aliases(trtllm),
            _aliases(vllm),
            _aliases(aliases),
            tuple(short),
            flag,
            metavar,
            parse,
            nargs,
            no_effect,
        )
    )
    return info


def only_values(value: Any, field: str, table: Mapping[str, tuple[tuple[Any, ...], str]]) -> Any:
    """A field validator's check for a peer's option where brisk has one behaviour: `table[field]` holds the values
    that mean it, and the reason any other is refused (`{value}` in it: the value given)."""
    accepted, reason = table[field]
    if value not in accepted:
        raise ValueError(reason.format(value=value))
    return value


def human_int(value: Any) -> Any:
    """vLLM's human-readable integers: 32k = 32,000 and 32K = 32,768 (lower case: powers of 1000, upper case: of
    1024, as vLLM reads them; 25.6k works, a fraction with an upper-case suffix does not); 32Ki = 32,768 too.
    Anything else is returned as it is, for the field's own validation."""
    if not isinstance(value, str):
        return value
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT]i?)", value.strip())
    if match is None:
        return value
    number, suffix = match.groups()
    power = "kmgt".index(suffix[0].lower()) + 1
    if suffix[0].islower() and not suffix.endswith("i"):
        return int(float(number) * 1000**power)
    return int(number) * 1024**power if number.isdigit() else value


def parse_human_int(text: str) -> int:
    """A flag's human-readable integer (`human_int`)."""
    value = human_int(text)
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (e.g. 4096, 32k, 32K, 1G)") from None


def spellings_of(info: FieldInfo) -> Spellings | None:
    return next((m for m in info.metadata if isinstance(m, Spellings)), None)


@dataclass(frozen=True)
class PeerOption:
    """A peer's option that brisk does not have (brisk/peer_options.py lists them). Given the value that means what
    brisk does anyway (`accepted`, as lower-case text: "false" for a switch; "*": any, a knob with no effect here) it
    is accepted and does nothing; any other value is refused with `reason`, never as an unknown option.
    docs/options.md lists them."""

    names: tuple[str, ...]  # vLLM's / trtllm's spellings (either of '-' and '_'); short flags start with one '-'
    reason: str
    accepted: tuple[str, ...] = ("false",)
    switch: bool = True  # a flag without a value (--name, --no-name); else it takes one value, or several (nargs)
    nargs: str | None = None

    def allows(self, value: Any) -> bool:
        text = _text_of(value).lower()
        if "*" in self.accepted or text in self.accepted:
            return True
        number = _number(text)  # 5 in a YAML file is the 5.0 vLLM's --help shows
        return number is not None and number in {_number(a) for a in self.accepted}


# ---- the table -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OptionRow:
    """One option as the table lists it."""

    model: type[BaseModel]  # whose field it is
    path: str  # its YAML path in brisk's spelling, dotted inside a group (kv_cache_config.dtype)
    annotation: Any
    info: FieldInfo
    spellings: Spellings
    group: bool = False  # a nested model of options (given whole as a mapping, or null where that is allowed)
    default: Any = None  # as declared (a test session may change a field's default later: conftest's cpu_kernels)

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    @property
    def help(self) -> str:
        return self.spellings.help

    @property
    def aliases(self) -> tuple[Alias, ...]:
        s = self.spellings
        return s.trtllm + s.vllm + s.aliases

    @property
    def flags(self) -> list[str]:
        """Every flag of the option (the first one is how --help and the docs show it)."""
        names = [self.path] if self.spellings.flag and "." not in self.path else []
        names += [a.name for a in self.aliases if not a.invert and not a.is_switch and "." not in a.name]
        flags: list[str] = []
        for name in names:
            for spelled in (name.replace("_", "-"), name.replace("-", "_")):
                if f"--{spelled}" not in flags:
                    flags.append(f"--{spelled}")
        return flags + list(self.spellings.short)

    def type_text(self) -> str:
        return _type_text(self.annotation)

    def range_text(self) -> str:
        parts = []
        for meta in self.info.metadata:
            for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
                bound = getattr(meta, attr, None)
                if bound is not None:
                    parts.append(f"{sign} {bound:g}" if isinstance(bound, float) else f"{sign} {bound}")
        choices = _choices(self.annotation)
        if choices:
            parts.append(" \\| ".join(str(c) for c in choices))
        return ", ".join(parts)


def _declared_default(info: FieldInfo, group: bool) -> Any:
    if info.default_factory is not None:
        return None if group else info.default_factory()  # type: ignore[call-arg]
    return None if info.default is PydanticUndefined else info.default


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(the annotation without None, whether None is allowed)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        inner = args[0] if len(args) == 1 else typing.Union[tuple(args)]  # noqa: UP007 (a runtime union)
        return inner, optional
    return annotation, False


def _choices(annotation: Any) -> tuple[Any, ...]:
    inner, _ = _unwrap(annotation)
    if typing.get_origin(inner) is Literal:
        return typing.get_args(inner)
    return ()


def _model_of(annotation: Any) -> type[BaseModel] | None:
    inner, _ = _unwrap(annotation)
    return inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None


def _asks_something(value: Any) -> bool:
    """Whether a value asks for something: not null, false, 0 or empty (a mapping: one of its values does)."""
    if isinstance(value, Mapping):
        return any(_asks_something(inner) for inner in value.values())
    return bool(value)


def _takes_mapping(annotation: Any) -> bool:
    """Whether an option's value is a mapping (a group, a model, or a dict; perhaps among other types)."""
    inner, _ = _unwrap(annotation)
    members = typing.get_args(inner) if typing.get_origin(inner) in (typing.Union, types.UnionType) else (inner,)
    return any(_model_of(m) is not None or m is dict or typing.get_origin(m) is dict for m in members)


def _type_text(annotation: Any) -> str:
    inner, optional = _unwrap(annotation)
    if _choices(annotation):
        text = "choice"
    elif _model_of(annotation) is not None:
        text = "mapping"
    elif typing.get_origin(inner) is list:
        (item,) = typing.get_args(inner)
        text = f"list of {getattr(item, '__name__', str(item))}"
    elif typing.get_origin(inner) in (typing.Union, types.UnionType):
        text = " or ".join(getattr(a, "__name__", str(a)) for a in typing.get_args(inner))
    else:
        text = getattr(inner, "__name__", str(inner))
    return f"{text} or null" if optional else text


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _text_of(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


class OptionTable:
    """The options of some config models, and what comes from them (see the module docstring)."""

    def __init__(
        self, *models: type[BaseModel], peers: Sequence[PeerOption] = (), containers: Mapping[str, str] | None = None
    ) -> None:
        """containers: keys whose mapping holds options as top-level keys (trtllm <= 0.20's pytorch_backend_config),
        each with one line of help for the docs."""
        self.models = models
        self.peers = tuple(peers)
        self.containers = dict(containers or {})
        self.rows: list[OptionRow] = []
        for model in models:
            self.rows += list(self._rows(model, model, ""))
        self.by_path = {row.path: row for row in self.rows}
        # top-level keys (every spelling, `-` as `_`) -> (row, alias or None for the option's own name)
        self._keys: dict[str, tuple[OptionRow, Alias | None]] = {}
        for row in self.rows:
            if "." not in row.path:
                self._add_key(row.path, row, None)
            for alias in row.aliases:
                if "." not in alias.name:  # a dotted spelling is the option's own path in a group (docs only)
                    self._add_key(alias.name, row, alias)
        # spellings inside a group (cuda_graph_config.padding_enabled) -> the option's row
        self._nested_keys = {
            a.name.replace("-", "_"): row
            for row in self.rows
            for a in row.aliases
            if "." in a.name and a.name != row.path
        }
        self._peer_keys: dict[str, PeerOption] = {}
        for peer in self.peers:
            for name in peer.names:
                key = name.lstrip("-").replace("-", "_")
                if key in self._keys or key in self._peer_keys:
                    raise ValueError(f"peer option {name!r} is declared twice")
                self._peer_keys[key] = peer

    def _add_key(self, name: str, row: OptionRow, alias: Alias | None) -> None:
        key = name.replace("-", "_")
        if key in self._keys and self._keys[key][0] is not row:
            raise ValueError(f"option spelling {name!r} is declared twice ({self._keys[key][0].path}, {row.path})")
        self._keys.setdefault(key, (row, alias))

    def _rows(self, owner: type[BaseModel], model: type[BaseModel], prefix: str) -> Iterator[OptionRow]:
        for name, info in model.model_fields.items():
            spellings = spellings_of(info)
            if spellings is None:
                continue  # not an option (EngineConfig.model: the positional MODEL)
            path = prefix + name
            nested = _model_of(info.annotation)
            grouped = nested is not None and any(spellings_of(i) for i in nested.model_fields.values())
            yield OptionRow(owner, path, info.annotation, info, spellings, grouped, _declared_default(info, grouped))
            if grouped and nested is not None:
                yield from self._rows(owner, nested, path + ".")

    # ---- resolving keys --------------------------------------------------------------------------------------
    def resolve(self, given: Mapping[str, Any], source: str) -> dict[type[BaseModel], dict[str, Any]]:
        """Each model's keyword dict (nested dicts for groups) from keys in any spelling; OptionError naming the
        key for an unknown one, or for two spellings of one option with different values."""
        out: dict[type[BaseModel], dict[str, Any]] = {model: {} for model in self.models}
        seen: dict[str, str] = {}  # option path -> the key that set it
        for key, spelled, value in self._unpacked(given, source):
            name = spelled.lstrip("-").replace("-", "_")
            found, peer = self._keys.get(name), self._peer_keys.get(name)
            inverse = name[3:] if name.startswith("no_") else _inverse_switch_name(name)
            if found is None and peer is None and inverse is not None and isinstance(value, bool):
                # vLLM's config files hold flags by name: `no-enable-prefix-caching: true` is that flag, and so is
                # `disable-prefix-caching: true` (vLLM >= 0.33)
                found, peer = self._keys.get(inverse), self._peer_keys.get(inverse)
                if (found is not None and _is_switch(*found)) or (peer is not None and peer.switch):
                    value = not value
                else:
                    found = peer = None
            if peer is not None:
                # null: the peer's own default (unset), which asks for nothing
                if value is not None and not peer.allows(value):
                    raise OptionError(f"option '{key}' in {source}: {peer.reason}")
                continue
            if found is None:
                raise OptionError(f"unknown option '{key}' in {source}{self.suggest(spelled)}")
            row, alias = found
            if alias is not None:
                value = alias.apply(value)
                if value is _UNSET:
                    continue
            self._place(out[row.model], row, value, source, str(key), seen)
        return out

    def _unpacked(self, given: Mapping[str, Any], source: str) -> Iterator[tuple[str, str, Any]]:
        """(the key as errors name it, the key, its value) for `given`'s keys, a container's (pytorch_backend_config's)
        in its place, named `container.key` in errors."""
        for key, value in given.items():
            container = str(key).lstrip("-").replace("-", "_")
            if container not in self.containers:
                yield str(key), str(key), value
            elif isinstance(value, Mapping):
                yield from ((f"{key}.{inner}", str(inner), inner_value) for inner, inner_value in value.items())
            elif value is not None:
                raise OptionError(f"'{key}' in {source} holds options by name: give a mapping (got {value!r})")

    def _place(
        self, root: dict[str, Any], row: OptionRow, value: Any, source: str, key: str, seen: dict[str, str]
    ) -> None:
        if value is None and row.annotation is not Any and not _unwrap(row.annotation)[1]:
            # null for an option that cannot be null is unset: TensorRT-LLM's and vLLM's unset options are null in
            # a dump of their args (max_batch_size: null, kv_cache_config.free_gpu_memory_fraction: null), and
            # brisk's default is what they then mean
            return
        *parents, last = row.path.split(".")
        into = root
        for part in parents:
            into = into.setdefault(part, {})
            if not isinstance(into, dict):
                # A part of a group that is off (null), given null, false, 0 or empty, asks for nothing the group's
                # absence does not give: TensorRT-LLM <= 1.0rc1's dump of its args holds use_cuda_graph: false
                # beside cuda_graph_max_batch_size: 0 and cuda_graph_padding_enabled: false.
                if not _asks_something(value):
                    return
                raise OptionError(f"'{key}' in {source} sets a part of '{part}', which is null there")
        if row.group and isinstance(value, BaseModel):
            value = value.model_dump(exclude_unset=True)
        if isinstance(value, str) and value.lstrip().startswith("{") and _takes_mapping(row.annotation):
            # vLLM's YAML files give JSON options as strings: speculative-config: '{"method": "ngram", ...}'
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise OptionError(f"'{key}' in {source} is not valid JSON: {exc}") from None
        if row.path in seen and seen[row.path] != key and into.get(last) != value:
            raise OptionError(f"'{seen[row.path]}' and '{key}' in {source} both set option '{row.path}'")
        seen[row.path] = key
        if value is None and _asks_something(into.get(last)):  # the same conflict, the part given first
            part = next(k for path, k in seen.items() if path.startswith(row.path + "."))
            raise OptionError(f"'{key}' in {source} sets '{row.path}' to null, and '{part}' sets a part of it")
        if not (row.group and isinstance(value, Mapping)):
            into[last] = value
            return
        if not isinstance(into.setdefault(last, {}), dict):  # {} too: a group given empty is given (its defaults)
            raise OptionError(f"'{key}' in {source} sets '{row.path}', which is null there")
        for child_key, child_value in value.items():
            child_path = f"{row.path}.{str(child_key).replace('-', '_')}"
            child = self.by_path.get(child_path) or self._nested_keys.get(child_path)
            if child is None:
                names = [r.name for r in self.rows if r.path.startswith(row.path + ".")]
                hint = _did_you_mean(str(child_key), names)
                raise OptionError(f"unknown option '{row.path}.{child_key}' in {source}{hint}")
            self._place(root, child, child_value, source, f"{key}.{child_key}", seen)

    def no_effect_notes(self, config: BaseModel, prefix: str = "") -> list[str]:
        """One start-up line for each no-effect option `config` (an option model, nested ones walked) was given."""
        notes = []
        for name in config.model_fields_set:
            value = getattr(config, name)
            row = self.by_path.get(prefix + name)
            if row is None:
                continue
            if row.spellings.no_effect:
                notes.append(f"{row.path} {_text_of(value)}: {row.help}")
            elif row.group and isinstance(value, BaseModel):
                notes += self.no_effect_notes(value, f"{row.path}.")
        return sorted(notes)

    def no_effect_fields(self, model: type[BaseModel]) -> dict[str, Any]:
        """pydantic's `exclude` for `model`'s no-effect options (nested groups as nested dicts): what a dump of the
        configuration in effect leaves out."""
        exclude: dict[str, Any] = {}
        for row in self.rows:
            if row.model is model and row.spellings.no_effect:
                *parents, last = row.path.split(".")
                into = exclude
                for part in parents:
                    into = into.setdefault(part, {})
                into[last] = True
        return exclude

    def knows(self, key: str) -> bool:
        """Whether `key` (any spelling; a dotted one inside a group or a container) is an option or a peer's option
        brisk refuses with a reason."""
        name = key.lstrip("-").replace("-", "_")
        outer, _, inner = name.partition(".")
        if inner:
            return name in self.by_path or name in self._nested_keys or (outer in self.containers and self.knows(inner))
        if name in self._keys or name in self._peer_keys or name in self.containers:
            return True
        inverse = name[3:] if name.startswith("no_") else _inverse_switch_name(name)  # a switch's opposite (resolve)
        found, peer = self._keys.get(inverse or ""), self._peer_keys.get(inverse or "")
        return (found is not None and _is_switch(*found)) or (peer is not None and peer.switch)

    def suggest(self, key: str) -> str:
        return _did_you_mean(key.lstrip("-").replace("-", "_"), list(self._keys))

    # ---- argparse --------------------------------------------------------------------------------------------
    def add_arguments(self, parser: argparse.ArgumentParser, models: Sequence[type[BaseModel]]) -> None:
        """One flag per spelling of each option of `models`; a parsed flag lands in the namespace under
        `option:KEY` (KEY: a spelling `resolve` takes), only when given."""
        for model in models:
            group = parser.add_argument_group(model.__doc__.split("\n")[0] if model.__doc__ else model.__name__)
            for row in self.rows:
                if row.model is model:
                    self._add_row_arguments(group, row)
        for peer in self.peers:  # hidden from --help (docs/options.md lists them): parsed to be refused with a reason
            flags = [f for n in peer.names for f in _flag_spellings(n)]
            dest = f"option:{peer.names[0].lstrip('-')}"
            if peer.switch:
                parser.add_argument(
                    *flags, dest=dest, action=_Switch, default=argparse.SUPPRESS, help=argparse.SUPPRESS
                )
            else:
                parser.add_argument(
                    *flags, dest=dest, nargs=peer.nargs, default=argparse.SUPPRESS, help=argparse.SUPPRESS
                )
        add_inverse_spellings(parser)

    def _add_row_arguments(self, parser: Any, row: OptionRow) -> None:
        flags = row.flags
        plain = (a.name for a in row.aliases if not (a.is_switch or a.invert or "." in a.name))
        key = row.path if "." not in row.path else next(plain, None)
        if flags and key is not None:
            kwargs = self._argument_kwargs(row)
            parser.add_argument(*flags, dest=f"option:{key}", default=argparse.SUPPRESS, help=_help_text(row), **kwargs)
        for alias in row.aliases:
            if not (alias.invert or alias.is_switch):
                continue
            spelled = [f"--{alias.name.replace('_', '-')}", f"--{alias.name.replace('-', '_')}"]
            action = _Switch  # --NAME true, --no-NAME false (a switch alias's other value leaves the option alone)
            if alias.is_switch:
                what = f"{_text_of(alias.when)}: `{row.path}: {_text_of(alias.sets)}`"
            else:
                what = f"the opposite of {row.path}"
            parser.add_argument(
                *dict.fromkeys(spelled),
                dest=f"option:{alias.name}",
                action=action,
                default=argparse.SUPPRESS,
                help=f"{what} (a peer's spelling)",
            )

    @staticmethod
    def _argument_kwargs(row: OptionRow) -> dict[str, Any]:
        s = row.spellings
        inner, _ = _unwrap(row.annotation)
        if s.parse is not None:
            kwargs: dict[str, Any] = {"type": s.parse}
        elif inner is bool:
            return {"action": _Switch}
        elif inner in (int, float, str):
            kwargs = {"type": inner, "metavar": row.name.upper()}
        elif _choices(row.annotation):
            kwargs = {"type": str, "metavar": "{" + ",".join(str(c) for c in _choices(row.annotation)) + "}"}
        else:
            kwargs = {"type": _json_value, "metavar": "JSON"}
        if s.nargs:  # a list given as several words
            kwargs = {"type": s.parse or str, "nargs": s.nargs, "metavar": row.name.upper()}
        if s.metavar:
            kwargs["metavar"] = s.metavar
        return kwargs

    @staticmethod
    def given(namespace: argparse.Namespace) -> dict[str, Any]:
        """The options given on the command line, as keys `resolve` takes."""
        return {k.removeprefix("option:"): v for k, v in vars(namespace).items() if k.startswith("option:")}

    # ---- docs ------------------------------------------------------------------------------------------------
    def markdown(self) -> str:
        """The table as markdown, one section per model (docs/options.md holds it between its markers)."""
        lines: list[str] = []
        for model in self.models:
            title = (model.__doc__ or model.__name__).strip().split("\n")[0]
            lines += [
                f"## {title}",
                "",
                "| option (YAML path) | flags | trtllm | vLLM | type | default | range | what it does |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for row in self.rows:
                if row.model is model:
                    lines.append(_markdown_row(row))
            lines.append("")
        if self.containers:
            lines += ["## Options given inside a mapping", "", "| key | what it holds |", "|---|---|"]
            lines += [f"| `{name}` | {text} |" for name, text in self.containers.items()]
            lines.append("")
        if self.peers:
            lines += [
                "## Peers' options brisk does not have",
                "",
                "Accepted with the value that means what brisk does anyway; any other value is refused with the reason.",
                "",
                "| flags (and YAML keys) | accepted | why others are refused |",
                "|---|---|---|",
            ]
            by_reason: dict[tuple[str, tuple[str, ...]], list[str]] = {}
            for peer in self.peers:
                by_reason.setdefault((peer.reason, peer.accepted), []).extend(_flag_spellings(n)[0] for n in peer.names)
            for (reason, accepted), flags in by_reason.items():
                values = ", ".join(f"`{a}`" if a else '`""`' for a in accepted)  # "": vLLM's empty default
                shown = "any (no effect)" if "*" in accepted else values or "none"
                lines.append(
                    f"| {', '.join(f'`{f}`' for f in flags)} | {shown} | {reason.replace('|', chr(92) + '|')} |"
                )
            lines.append("")
        return "\n".join(lines).rstrip() + "\n"


class _Switch(argparse.Action):
    """A bool flag: `--name` sets true; `--no-name` (of its dashed spellings) false, and so does the inverse of an
    `--enable-x` / `--disable-x` spelling (`--disable-x` / `--enable-x`, vLLM's since 0.33) that is no flag of its
    own (`add_inverse_spellings`)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        negated = [f"--no-{s[2:]}" for s in option_strings if s.startswith("--") and "_" not in s]
        self.negative = set(negated)
        super().__init__(option_strings + negated, dest, nargs=0, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, option_string not in self.negative)


def _inverse_switch_name(name: str) -> str | None:
    """`disable_x` for `enable_x` and the reverse (a key or a flag without its dashes); None for other names."""
    for prefix, inverse in (("enable", "disable"), ("disable", "enable")):
        for sep in ("_", "-"):
            if name.startswith(prefix + sep):
                return inverse + name[len(prefix) :]
    return None


def add_inverse_spellings(parser: argparse.ArgumentParser) -> None:
    """Give each switch spelled `--enable-x` (or `--disable-x`) its inverse as a false spelling, as vLLM's parser does
    since 0.33, wherever no flag of the parser already has that spelling."""
    taken = parser._option_string_actions  # argparse's own table of spellings; argument groups share it
    for action in list(parser._actions):
        if not isinstance(action, _Switch):
            continue
        for flag in [f for f in action.option_strings if f.startswith("--") and f not in action.negative]:
            inverse = _inverse_switch_name(flag[2:])
            if inverse is not None and f"--{inverse}" not in taken:
                taken[f"--{inverse}"] = action
                action.option_strings = [*action.option_strings, f"--{inverse}"]
                action.negative.add(f"--{inverse}")


def _is_switch(row: OptionRow, alias: Alias | None) -> bool:
    """Whether a key is a switch: a bool option, or a spelling of an option that is one (inverted, or setting a value)."""
    if alias is not None and (alias.invert or alias.is_switch):
        return True
    return _unwrap(row.annotation)[0] is bool


def _flag_spellings(name: str) -> list[str]:
    """A peer option's flags: `-x` as given; a long name with '-' and with '_'."""
    if name.startswith("-"):
        return [name]
    return list(dict.fromkeys((f"--{name.replace('_', '-')}", f"--{name.replace('-', '_')}")))


def _did_you_mean(key: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(key.replace("-", "_"), choices, n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _help_text(row: OptionRow) -> str:
    text = row.help
    if row.default is not None and not row.group:
        text += f" (default: {_text_of(row.default)})"
    return text.replace("%", "%%")


def _spelled(aliases: tuple[Alias, ...], as_flags: bool) -> str:
    """Spellings for the docs: vLLM's as flags (`--max-num-seqs`), trtllm's as its flags and YAML keys are."""
    out = []
    for a in aliases:
        name = f"--{a.name.replace('_', '-')}" if as_flags and "." not in a.name else a.name
        if a.invert:
            out.append(f"`{name}` (inverted)")
        elif a.is_switch and a.when:
            out.append(f"`{name}` (= `{_text_of(a.sets)}`)")
        elif a.is_switch:
            out.append(f"`{name}` (false = `{_text_of(a.sets)}`)")
        else:
            out.append(f"`{name}`")
    return ", ".join(out)


def _markdown_row(row: OptionRow) -> str:
    s = row.spellings
    flags = ", ".join(
        f"`{f}`" for f in row.flags[:1] + [f for f in row.flags[1:] if f.startswith("-") and "_" not in f]
    )
    cells = [
        f"`{row.path}`",
        flags,
        _spelled(s.trtllm, as_flags=False),
        _spelled(s.vllm, as_flags=True),
        row.type_text(),
        "" if row.group else f"`{_text_of(row.default)}`",
        row.range_text(),
        row.help.replace("|", "\\|"),
    ]
    return "| " + " | ".join(cells) + " |"
