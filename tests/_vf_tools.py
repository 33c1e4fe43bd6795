"""A multi-turn verifiers environment with a tool, for the tests: the model answers the tiny world's
additions by calling `check(answer)`; a wrong answer's tool result says `no <question>` and the model may
call again (up to three calls). Written with the package's own classes and reached through its module's
`load_environment(**kwargs)`; the harness runs the tool in-process (verifiers' MCP tool servers are
built with uv, which an offline test cannot do).

The tiny model writes digits only, so the tests give its endpoint a parser (`tiny_check`: a reply of
digits is a call check(answer=<digits>)) and a chat template that renders tool calls and results in its
alphabet (test_agents_verifiers.py).
"""
import json
import ssl

import httpx
import verifiers.v1 as vf
from openai import AsyncOpenAI

from phaserl.world import prepare_tiny_world

CHECK = {"type": "function", "function": {"name": "check", "description": "Check an answer to the question.",
                                          "parameters": {"type": "object", "required": ["answer"],
                                                         "properties": {"answer": {"type": "string"}}}}}


TLS = ssl.create_default_context()  # made once: loading the CA bundle for every episode's client is slow

class CheckData(vf.TaskData):
    answer: str


class CheckTask(vf.Task[CheckData]):
    @vf.reward(weight=1.0)
    async def solved(self, trace: vf.Trace) -> float:
        return float("right" in trace.info.get("checks", []))

    @vf.metric
    async def checks(self, trace: vf.Trace) -> float:
        return float(len(trace.info.get("checks", [])))


class CheckConfig(vf.TasksetConfig):
    split: str = "train"
    num_tasks: int = 64


class CheckTaskset(vf.Taskset[CheckTask, CheckConfig]):
    def load(self):
        world = prepare_tiny_world()
        with open(world.train_file if self.config.split == "train" else world.val_file) as f:
            rows = [json.loads(line) for line in f][: self.config.num_tasks]
        return [CheckTask(CheckData(prompt=r["prompt"][0]["content"], answer=r["reward_model"]["ground_truth"]),
                          self.config.task) for r in rows]


class ToolLoop(vf.Harness[vf.HarnessConfig]):
    """Chat with the `check` tool offered; run each call, send its result back; stop when right, when the model
    answers without a call, or after three calls."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0,
                             http_client=httpx.AsyncClient(verify=TLS, timeout=None))
        messages = [{"role": "user", "content": data.prompt}]
        checks = trace.info.setdefault("checks", [])
        try:
            for _ in range(3):
                reply = (await client.chat.completions.create(model=ctx.model, messages=messages,
                                                              tools=[CHECK])).choices[0].message
                if not reply.tool_calls:
                    break
                messages.append(reply.model_dump(exclude_none=True))
                for call in reply.tool_calls:
                    answer = json.loads(call.function.arguments).get("answer", "")
                    checks.append("right" if answer == trace.task.data.answer else "no")
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": "right" if checks[-1] == "right" else f"no {data.prompt}"})
                if checks[-1] == "right":
                    break
        finally:
            await client.close()
        return vf.ProgramResult(0, "", "")


def load_environment(split: str = "train", num_tasks: int = 64, runtime: str = "subprocess"):
    config = vf.resolve_env_config({"taskset": {"id": __name__, "split": split, "num_tasks": num_tasks},
                                    "agent": {"runtime": {"type": runtime}}})
    return vf.load_environment(config)


__all__ = ["CheckTaskset", "ToolLoop"]
