"""Serve's model catalog: the servable models (one engine each), the restraints registered in the config or while
serving, and the `model+restraint` variants they make."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from rolemrc.intervene.fit import check_origin
from rolemrc.intervene.spec import KindUnsupportedError, LoraRankError, Restraint, RestraintError
from rolemrc.serve.config import ServeConfig
from rolemrc.serve.engines import engine_class
from rolemrc.serve.engines.base import ClientRestraint, Engine, Resolved
from rolemrc.serve.errors import ApiError, ServeConfigError
from rolemrc.serve.protocol import ModelCard

log = logging.getLogger("rolemrc.serve")


class ModelCatalog:
    """What this server can answer: `engines` by model name, `restraints` by name, `variants` by model id."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.created = int(time.time())
        self.restraints: dict[str, Restraint] = {}
        for name, path in config.restraints.items():
            try:
                self.restraints[name] = Restraint.load(path)
            except RestraintError as exc:
                raise ServeConfigError(f"restraint {name!r}: {exc}") from None
        self.engines: dict[str, Engine] = {}
        for name, model in config.models.items():
            try:
                self.engines[name] = engine_class(model.engine)(
                    name, model.options, max_batch=config.max_batch, max_queue=config.max_queue)
            except (OSError, ValueError, RuntimeError) as exc:
                raise ServeConfigError(f"model {name!r} did not load: {exc}") from exc
        self.variants: dict[str, tuple[str, str | None]] = {name: (name, None) for name in self.engines}
        self._registering = asyncio.Lock()
        for name, engine in self.engines.items():
            fitting = {rname: r for rname, r in self.restraints.items() if self._refusal(name, engine, rname, r) is None}
            self.variants |= {f"{name}+{rname}": (name, rname) for rname in fitting}
            if engine.capabilities.lora_restraints:
                engine.register_adapters(fitting, inline=config.allow_inline_restraints)

    def _serves(self, name: str, engine: Engine, restraint: Restraint) -> RestraintError | None:
        """None when `engine` (model `name`) serves `restraint` at runtime, else why not."""
        if not engine.capabilities.runtime_restraints:
            return RestraintError(f"the {engine.kind} engine applies no restraints at runtime")
        try:
            engine.check_restraint(restraint)
            self._check_model(name, restraint)
        except RestraintError as exc:
            return exc
        return None

    def _refusal(self, name: str, engine: Engine, rname: str, restraint: Restraint) -> RestraintError | None:
        """None when `engine` serves `restraint`, else why not (logged)."""
        why = self._serves(name, engine, restraint)
        if why is not None and engine.capabilities.runtime_restraints:
            log.warning("restraint %r does not fit model %r: %s", rname, name, why)
        return why

    def _check_model(self, name: str, restraint: Restraint) -> None:
        """With `strict_restraints`, a RestraintError for a restraint selected on another model than `name`'s (without
        it, the engine's check logs a warning once)."""
        if self.config.strict_restraints:
            for directory in self.config.models[name].directories():
                check_origin(restraint, directory, strict=True, shape=False)

    async def register(self, rname: str, restraint: Restraint) -> tuple[bool, list[str]]:
        """Register a restraint while serving (idempotent for the same `Restraint.digest`: units, hook and factor):
        (whether it is new, the models it fits). 409 when the name holds a different restraint; 422 when it fits
        no model. Its variants are listed and routable once every engine serving it as an adapter has loaded it; a
        failure (502 `adapter_failed` from an engine) leaves no variant and no adapter behind."""
        async with self._registering:
            if rname in self.restraints:
                if self.restraints[rname].digest != restraint.digest:
                    raise restraint_exists(rname)
                return False, self.fitted(rname)
            self._check_room()
            refusals = await asyncio.to_thread(   # off the loop: the checks may fingerprint a model's weights
                lambda: {name: self._refusal(name, engine, rname, restraint) for name, engine in self.engines.items()})
            fits = [name for name, why in refusals.items() if why is None]
            if not fits:
                raise fits_none(rname, refusals)
            await self._add_adapters(rname, restraint, fits)
            self.restraints[rname] = restraint
            self.variants |= {f"{name}+{rname}": (name, rname) for name in fits}
            return True, fits

    async def _add_adapters(self, rname: str, restraint: Restraint, fits: list[str]) -> None:
        """Load `restraint` on each of the models `fits` that serve restraints as adapters: on all, or (unloaded
        again from those that took it) on none."""
        added: list[str] = []
        try:
            for name in fits:
                if self.engines[name].capabilities.lora_restraints:
                    await self.engines[name].add_adapter(rname, restraint)
                    added.append(name)
        except BaseException:
            for name in added:
                with contextlib.suppress(Exception):
                    await self.engines[name].remove_adapter(rname)
            raise

    async def check(self, rname: str, restraint: Restraint) -> None:
        """The 422s `register` answers for a new `rname` (too many registered, fits no model), without registering
        it: a replica refuses a restraint before the shared store keeps it for every replica."""
        if rname not in self.restraints:
            self._check_room()
        refusals = await asyncio.to_thread(
            lambda: {name: self._serves(name, engine, restraint) for name, engine in self.engines.items()})
        if all(refusals.values()):
            raise fits_none(rname, refusals)

    def _check_room(self) -> None:
        registered = len(set(self.restraints) - set(self.config.restraints))
        if registered >= self.config.max_registered_restraints:
            raise ApiError(422, f"{registered} restraints are registered while serving, this server's limit "
                                f"(max_registered_restraints); delete some first", code="too_many_restraints",
                           param="name")

    async def unregister(self, rname: str) -> None:
        """Stop serving a restraint registered while serving: its variants go and its name is free again."""
        async with self._registering:
            for vid, (name, r) in list(self.variants.items()):
                if r == rname:
                    if self.engines[name].capabilities.lora_restraints:
                        await self.engines[name].remove_adapter(rname)
                    del self.variants[vid]
            self.restraints.pop(rname, None)

    def fitted(self, rname: str) -> list[str]:
        """The models serving the registered restraint `rname`."""
        return [name for name, r in self.variants.values() if r == rname]

    async def start(self) -> None:
        for name, engine in self.engines.items():
            try:
                await engine.start()
            except (OSError, RuntimeError, ServeConfigError) as exc:
                raise ServeConfigError(f"model {name!r} did not start: {exc}") from exc

    async def stop(self) -> None:
        for engine in self.engines.values():
            await engine.stop()

    def cards(self) -> list[ModelCard]:
        return [ModelCard(id=vid, created=self.created, root=name, restraint=rname, engine=self.config.models[name].engine,
                          lora=getattr(self.engines[name], "lora_path", None)) for vid, (name, rname) in self.variants.items()]

    def lookup(self, model_id: str) -> tuple[Engine, str | None]:
        """(engine, restraint named by the id) for `model` or `model+restraint`; 404 otherwise."""
        if model_id in self.variants:
            name, rname = self.variants[model_id]
            return self.engines[name], rname
        name, _, rname = model_id.partition("+")
        if name in self.engines and rname in self.restraints:
            raise ApiError(400, f"restraint {rname!r} does not fit model {name!r}", code="restraint_mismatch",
                           param="model")
        if name in self.engines and rname:
            raise ApiError(404, f"unknown restraint {rname!r} in model id {model_id!r}", code="restraint_not_found",
                           param="model")
        raise ApiError(404, f"the model {model_id!r} does not exist; GET /v1/models lists them",
                       code="model_not_found", param="model")

    def parse_spec(self, spec: dict[str, Any], param: str, *, inline: bool = True) -> Restraint:
        """A client's restraint spec as a Restraint: 400 when this server takes none (allow_inline_restraints),
        422 when invalid or, sent inline with a request, larger than max_inline_units (a registration, an admin's,
        is checked once and served by name: any size the body limit lets through)."""
        if not self.config.allow_inline_restraints:
            raise ApiError(400, "restraint specs from clients are disabled on this server (allow_inline_restraints)",
                           code="inline_restraints_disabled", param=param)
        count = sum(len(ids) for field in ("units", "directions") if isinstance(spec.get(field), dict)
                    for ids in spec[field].values() if isinstance(ids, list | tuple))
        if inline and count > self.config.max_inline_units:   # counted before any unit is parsed or checked
            raise ApiError(422, f"the restraint has {count} units and direction entries; this server's limit is "
                                f"{self.config.max_inline_units}", code="restraint_too_large", param=param)
        try:
            return Restraint.from_dict(spec)
        except (RestraintError, TypeError, AttributeError, ValueError) as exc:
            raise ApiError(422, f"invalid restraint spec: {exc}", code="invalid_restraint", param=param) from None

    def resolve(self, engine: Engine, named: str | None, requested: ClientRestraint | None) -> Resolved:
        """The restraint for a request: from the model id, or the request's `restraint` (a registered
        name, or an inline spec if allowed). 404 unknown name, 400 not allowed, 422 invalid spec. The restraint is
        validated against the model once: a registered one when it was registered, an inline one here."""
        if named is not None and requested is not None:
            raise ApiError(400, "the model id already names a restraint; drop the 'restraint' field",
                           param="restraint")
        if named is not None:
            return Resolved(self.restraints[named], named, f"name:{named}", named)
        if requested is None:
            return Resolved()
        if not engine.capabilities.runtime_restraints:   # the upstream applies it, if the engine may forward it
            engine.check_restraint(requested)
            return Resolved(None, self.upstream_label(engine, requested), "", requested)
        if isinstance(requested, str):
            if requested not in self.restraints:
                raise ApiError(404, f"unknown restraint {requested!r}; registered: {sorted(self.restraints)}",
                               code="restraint_not_found", param="restraint")
            restraint, label, key = self.restraints[requested], requested, f"name:{requested}"
            if f"{engine.name}+{requested}" in self.variants:   # checked against this model when registered
                return Resolved(restraint, label, key, requested)
        else:
            restraint = self.parse_spec(requested, "restraint")
            label, key = "inline", f"inline:{restraint.digest}"   # by what it does: equal specs batch together
        try:
            engine.check_restraint(restraint)
            self._check_model(engine.name, restraint)
        except KindUnsupportedError as exc:
            raise ApiError(422, f"model {engine.name!r} cannot serve a {restraint.kind} restraint: {exc}",
                           code="restraint_kind_unsupported", param="restraint") from None
        except RestraintError as exc:
            raise ApiError(422, f"the restraint does not fit model {engine.name!r}: {exc}", code="invalid_restraint",
                           param="restraint") from None
        return Resolved(restraint, label, key, requested)

    def upstream_label(self, engine: Engine, requested: str | dict) -> str:
        """The metric and log label of a restraint an upstream applies: its name where this server lists it (a
        registered restraint, a `model+name` variant), else "inline" or "unlisted", so a client's strings cannot grow
        the label set."""
        if not isinstance(requested, str):
            return "inline"
        return requested if requested in self.restraints or f"{engine.name}+{requested}" in self.variants else "unlisted"


def restraint_exists(name: str) -> ApiError:
    """409: `name` holds another restraint (a name holds one until it is deleted)."""
    return ApiError(409, f"restraint {name!r} is registered with other units, hook or factor", code="restraint_exists",
                    param="name")


def fits_none(rname: str, refusals: dict[str, RestraintError]) -> ApiError:
    """422 for a restraint no served model takes, with each model's reason: `restraint_needs_bake` where a model
    refused it only as a restraint applied at runtime (a kind it cannot apply, more units than its LoRA rank holds),
    which that model serves baked into a checkpoint of its own; else `invalid_restraint`."""
    why = "; ".join(f"{name!r}: {exc}" for name, exc in refusals.items())
    baked = any(isinstance(exc, (KindUnsupportedError, LoraRankError)) for exc in refusals.values())
    return ApiError(422, f"restraint {rname!r} fits none of the served models ({why})",
                    code="restraint_needs_bake" if baked else "invalid_restraint", param="spec")
