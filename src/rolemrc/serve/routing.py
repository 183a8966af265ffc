"""Where a request goes and how it decodes: `route` picks its model and restraint (from the model id, the `restraint`
field, or the arm an experiment assigns its user), `sampling_params` its decoding settings within the server's
limits."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

from rolemrc.generate.params import SamplingParams
from rolemrc.serve import protocol as p
from rolemrc.serve.config import ServeConfig
from rolemrc.serve.engines.base import Engine, Resolved
from rolemrc.serve.errors import ApiError
from rolemrc.serve.experiments import assign
from rolemrc.serve.state import State

HIDDEN = "<arm>"   # what the errors of an experiment that hides its arms say instead of the arm's names


@dataclass
class Route:
    """Where one request goes. `reveal`: whether its response says so (an experiment's `reveal_arm`); `refused`: why
    the arm it was assigned cannot serve it (its engine then None): the request is logged, refused, all the same."""

    model_id: str
    engine: Engine | None
    resolved: Resolved
    experiment: str | None = None
    arm: str | None = None
    reveal: bool = True
    refused: ApiError | None = None

    def conceal(self, error: ApiError) -> ApiError:
        """`error` as its client hears it: as is where the route reveals its arm, else with each of the arm's names
        (its own, its model id and that id's parts: model and restraint) said as HIDDEN."""
        if self.reveal:
            return error
        names = sorted({self.arm, self.model_id, *self.model_id.split("+")} - {""}, key=len, reverse=True)
        said = re.sub(rf"(?<!\w)(?:{'|'.join(map(re.escape, names))})(?!\w)", HIDDEN, error.message)
        return error.reworded(said)


async def route(state: State, body: p.SamplingFields) -> Route:
    """The request's model and restraint: from the model id and `restraint`, or from the arm its user is assigned."""
    catalog = state.catalog
    if body.experiment is None:
        await state.fetch_restraints(body.model.partition("+")[2], body.restraint)
        engine, named = catalog.lookup(body.model)
        return Route(body.model, engine, await resolve(state, engine, named, body.restraint))
    if body.restraint is not None:
        raise ApiError(400, "a request in an experiment gets its restraint from the arm; drop 'restraint'",
                       param="restraint")
    exp = await state.experiment(body.experiment)
    arm = assign(exp["id"], exp["arms"], body.user)
    try:
        return await arm_route(state, exp, arm)
    except ApiError as exc:   # assigned, so counted in its arm: a request its arm cannot take is logged as refused
        restraint = arm.get("restraint") or arm["model"].partition("+")[2] or None
        model_id = f"{arm['model']}+{arm['restraint']}" if arm.get("restraint") else arm["model"]
        return Route(model_id, None, Resolved(label=restraint or "none", raw=restraint), exp["id"], arm["name"],
                     exp.get("reveal_arm", True), exc)


async def arm_route(state: State, exp: dict, arm: dict) -> Route:
    """The route of a request `exp` assigned to `arm`."""
    catalog = state.catalog
    await state.fetch_restraints(arm["model"].partition("+")[2], arm.get("restraint"))
    engine, named = catalog.lookup(arm["model"])
    if named is None and arm.get("restraint"):
        resolved = await resolve(state, engine, None, arm["restraint"])
    else:
        resolved = catalog.resolve(engine, named, None)
    model_id = arm["model"] if named or not arm.get("restraint") else f"{arm['model']}+{arm['restraint']}"
    return Route(model_id, engine, resolved, exp["id"], arm["name"], exp.get("reveal_arm", True))


async def resolve(state: State, engine: Engine, named: str | None, requested: str | dict | None) -> Resolved:
    """`catalog.resolve`, off the event loop for an inline spec: checking it may fingerprint the model's weights
    (a spec that records the model it was selected on), seconds on a large model the first time (then cached)."""
    if isinstance(requested, dict):
        return await asyncio.to_thread(state.catalog.resolve, engine, named, requested)
    return state.catalog.resolve(engine, named, requested)


def sampling_params(config: ServeConfig, body: p.SamplingFields, engine: Engine) -> SamplingParams:
    """The request's decoding settings, `max_tokens` always set (the server's default when the client gave none, which
    an engine that knows the context window lowers to the room the prompt leaves); 400 for what this server or
    `engine` does not honour."""
    if (refused := body.refused()) is not None:
        raise ApiError(400, refused[1], code="unsupported_parameter", param=refused[0])
    logprobs = body.top_logprobs_count()
    if logprobs is not None and not engine.capabilities.logprobs:
        raise ApiError(400, f"the {engine.kind} engine serving this model does not return logprobs",
                       code="unsupported_parameter", param="logprobs")
    response_format = body.response_format.constrained() if getattr(body, "response_format", None) else None
    if response_format is not None and not engine.capabilities.structured_outputs:
        raise ApiError(400, f"the {engine.kind} engine serving this model cannot constrain replies to "
                            f"{response_format['type']} (serve it with engine: vllm)",
                       code="unsupported_parameter", param="response_format")
    max_tokens = body.requested_max_tokens()
    if max_tokens is not None and max_tokens > config.max_new_tokens:
        raise ApiError(400, f"max_tokens {max_tokens} is over this server's limit of {config.max_new_tokens}",
                       code="max_tokens_too_large", param="max_tokens")
    return SamplingParams(max_tokens=config.default_max_tokens if max_tokens is None else max_tokens,
                          fit_to_context=max_tokens is None, temperature=body.temperature, top_p=body.top_p,
                          seed=body.seed, stop=body.stops(), ignore_eos=body.ignore_eos, logprobs=logprobs,
                          echo=body.echo_prompt(), prompt_logprobs=logprobs is not None and body.echo_prompt(),
                          response_format=response_format)
