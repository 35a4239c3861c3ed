"""session.config: the job's config read by section, with typed values.

    cfg = session.config
    cfg.teacher.topk                    # int
    cfg["loss"]["temperature"]          # float
    cfg.teacher.cache.max_bytes         # int (bytes)
    cfg.checkpoint.async_               # bool (cfg["checkpoint"]["async"]: `async` is a keyword)
    cfg.teacher.cache.keys_             # str (cfg["teacher"]["cache"]["keys"]: `keys` is the mapping's method)
    cfg.trainer                         # the trainer's own keys, key -> text
    cfg["run.log_dir"]                  # "section.key": the value as text, as iterating gives it

The classes below mirror configs/reference.yaml (tests/python/test_typing.py checks that they
name every key of the schema). Enumerations (loss.kind, teacher.cache.mode, ...) are their names
as str; lists are lists of str; byte sizes are ints.
"""

from typing import Any, Dict, Iterator, List, Literal, Mapping, Type, Union, get_type_hints, overload

__all__ = [
    "Config",
    "Section",
    "RunConfig",
    "TeacherCacheConfig",
    "TeacherHeadConfig",
    "TeacherConfig",
    "StudentConfig",
    "TransportConfig",
    "LossConfig",
    "CheckpointConfig",
]


def _unescape(text: str) -> str:
    r"""A quoted config string's body without its escapes (\" \\ \n \t \xNN), as the C++ binding does."""
    out: List[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch != "\\" or i + 1 >= len(text):
            out.append(ch)
            i += 1
            continue
        e = text[i + 1]
        if e == "x" and i + 3 < len(text):
            out.append(chr(int(text[i + 2:i + 4], 16)))
            i += 4
            continue
        out.append({"n": "\n", "t": "\t"}.get(e, e))
        i += 2
    return "".join(out)


def _parse_list(text: str) -> List[str]:
    """A list value as the binding gives it, '["a", "b"]', as ["a", "b"]."""
    items: List[str] = []
    i, n = text.find("[") + 1, len(text)
    while i < n:
        if text[i] != '"':
            i += 1
            continue
        j = i + 1
        while j < n and text[j] != '"':
            j += 2 if text[j] == "\\" else 1
        items.append(_unescape(text[i + 1:j]))
        i = j + 1
    return items


def _convert(key: str, text: str, kind: Any) -> Any:
    """`text` (session.config's value of `key`) as a value of `kind`."""
    from . import _C

    try:
        if kind is bool:
            if text not in ("true", "false"):
                raise ValueError(text)
            return text == "true"
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        if kind == List[str]:
            return _parse_list(text)
        return text
    except ValueError:
        raise _C.InternalError(f"session.config: {key} = '{text}' is not a {getattr(kind, '__name__', kind)}") from None


class Section(Mapping[str, Any]):
    """One section of the config: its keys as typed attributes, and as a read-only mapping
    (section["key"]) of the same values. A key the C++ schema has and this class does not name
    is still there, by key, as its text."""

    def __init__(self, text: Mapping[str, str], prefix: str) -> None:
        """Args:
            text: every key of the config, "section.key" -> its value as text (the binding's).
            prefix: this section's dotted name ("loss", "teacher.cache").
        """
        values: Dict[str, Any] = {}
        for field, kind in get_type_hints(type(self)).items():
            if field.startswith("_"):
                continue
            key = field.rstrip("_")  # async_ -> async
            path = f"{prefix}.{key}"
            if isinstance(kind, type) and issubclass(kind, Section):
                values[key] = kind(text, path)
            elif path in text:
                values[key] = _convert(path, text[path], kind)
            object.__setattr__(self, field, values.get(key))
        for path, value in text.items():  # keys this class does not name yet: their text
            if path.startswith(prefix + ".") and "." not in path[len(prefix) + 1:]:
                values.setdefault(path[len(prefix) + 1:], value)
        object.__setattr__(self, "_prefix", prefix)
        object.__setattr__(self, "_values", values)

    def __getitem__(self, key: str) -> Any:
        try:
            return self._values[key]
        except KeyError:
            raise KeyError(f"{self._prefix}.{key}: no such config key (keys: {', '.join(self._values)})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"session.config.{self._prefix} is read-only")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"

    _prefix: str
    _values: Dict[str, Any]


class RunConfig(Section):
    """run: how the job is laid out and how long anything may wait."""

    name: str
    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    log_dir: str
    file_mode: str
    startup_timeout_s: float
    collective_timeout_s: float
    hang_timeout_s: float
    on_hang: str
    stop_grace_s: float
    status_every_s: float
    seed: int
    steps: int


class TeacherCacheConfig(Section):
    """teacher.cache: the teacher-output cache."""

    path: str
    mode: str
    max_bytes: int
    on_corrupt: str
    keys_: str  # the key `keys` (a Mapping's method name); section["keys"] reads it too
    dtype: str  # float16 | float32: how float32 logits and top-k values are stored


class TeacherHeadConfig(Section):
    """teacher.head: the teacher's output layer, with teacher.answer hidden (docs/teacher.md)."""

    weight: str  # a parameter or buffer name of the model: [V_t, d_t]
    bias: str  # "" : none
    softcap: float  # > 0: logits = softcap * tanh(logits / softcap); 0: none
    scale: float  # logits *= scale before the softcap; 1: none
    on_change: str  # refuse | adopt: a restarted teacher publishing another head


class TeacherConfig(Section):
    """teacher: the model served by the node's teacher process(es)."""

    kind: str
    path: str
    library: str
    module: str
    weights: str
    method: str
    inputs: List[str]
    output: str
    hidden_states: List[str]
    device: str
    procs: int
    devices: List[str]
    autocast: str
    max_batch_tokens: int
    topk: int
    samples: int
    request_ids: int
    payload_dtype: str
    vocab_size: int
    max_restarts: int
    threads: int
    on_nonfinite: str
    cache: TeacherCacheConfig
    answer: str  # auto | logits | topk | hidden
    hidden_size: int  # answer hidden: d_t (0: unknown)
    head: TeacherHeadConfig


class StudentConfig(Section):
    """student: the trainer side."""

    grad_acc_steps: int
    in_flight: int
    device: str
    backend: str
    bucket_mb: float


class TransportConfig(Section):
    """transport: the shared-memory rings between the students and the teacher of a node."""

    slots: int
    max_request_bytes: int
    max_response_bytes: int
    heartbeat_ms: int
    stall_timeout_s: float
    spin_us: int
    cuda_ipc: str
    cuda_mps: str


class LossConfig(Section):
    """loss: the distillation loss."""

    kind: str
    temperature: float
    alpha: float
    jsd_beta: float
    ignore_index: int
    chunk_tokens: int
    vocab: str
    max_truncated_mass: float
    on_nonfinite: str


class CheckpointConfig(Section):
    """checkpoint: student-only checkpoints."""

    dir: str
    every_steps: int
    keep_last: int
    async_: bool  # the key `async` (a Python keyword); section["async"] reads it too
    resume: bool
    on_error: str
    on_corrupt: str


_SECTIONS: Dict[str, Type[Section]] = {
    "run": RunConfig,
    "teacher": TeacherConfig,
    "student": StudentConfig,
    "transport": TransportConfig,
    "loss": LossConfig,
    "checkpoint": CheckpointConfig,
}


class Config(Mapping[str, Any]):
    """The job's config (session.config).

    By section: config.loss.temperature and config["loss"]["temperature"] are the same float;
    config.trainer is the trainer's own section (key -> text). As a mapping, its keys are the
    "section.key" names of every key (trainer keys too), each with its value as text:
    config["run.log_dir"] is the path; lists read '["a", "b"]'.
    """

    def __init__(self, text: Mapping[str, str]) -> None:
        """Args:
            text: every key of the config, "section.key" -> its value as text (the binding's).
        """
        self._text = dict(text)
        self.run = RunConfig(text, "run")
        self.teacher = TeacherConfig(text, "teacher")
        self.student = StudentConfig(text, "student")
        self.transport = TransportConfig(text, "transport")
        self.loss = LossConfig(text, "loss")
        self.checkpoint = CheckpointConfig(text, "checkpoint")
        self.trainer: Dict[str, str] = {k[len("trainer."):]: v for k, v in text.items() if k.startswith("trainer.")}

    @overload
    def __getitem__(self, key: Literal["run"]) -> RunConfig: ...
    @overload
    def __getitem__(self, key: Literal["teacher"]) -> TeacherConfig: ...
    @overload
    def __getitem__(self, key: Literal["student"]) -> StudentConfig: ...
    @overload
    def __getitem__(self, key: Literal["transport"]) -> TransportConfig: ...
    @overload
    def __getitem__(self, key: Literal["loss"]) -> LossConfig: ...
    @overload
    def __getitem__(self, key: Literal["checkpoint"]) -> CheckpointConfig: ...
    @overload
    def __getitem__(self, key: Literal["trainer"]) -> Dict[str, str]: ...
    @overload
    def __getitem__(self, key: str) -> Any: ...

    def __getitem__(self, key: str) -> Union[Section, Dict[str, str], str]:
        """A section by name ("loss"), or a key's text by its dotted name ("loss.temperature").

        Raises:
            KeyError: `key` is neither a section nor a key of the config.
        """
        if key in _SECTIONS or key == "trainer":
            section: Union[Section, Dict[str, str]] = getattr(self, key)
            return section
        try:
            return self._text[key]
        except KeyError:
            raise KeyError(f"{key}: no such config key or section (sections: "
                           f"{', '.join([*_SECTIONS, 'trainer'])})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._text)

    def __len__(self) -> int:
        return len(self._text)

    def __repr__(self) -> str:
        return f"distill.Config({len(self._text)} keys: {', '.join([*_SECTIONS, 'trainer'])})"
