"""A verifiers environment that `phaserl train` runs as its episode source (agent.harness: verifiers).

    pip install "phaserl[verifiers]"            # Python >= 3.11

Written with verifiers' own classes, as an Environments Hub package would be: the tiny world's additions as
a taskset (`split`, `num_tasks`), a rubric (`@vf.reward` correct, `@vf.metric` reply_chars), and a harness
that drives each task's conversation through the OpenAI client it is given (here one streamed request, in
process; a Hub package would ship or name its own, e.g. verifiers' `bash` or `null`). phaserl runs the
environment's own episodes against its endpoint and trains on the ids that endpoint sampled:

    model: {path: tiny}
    data: {max_prompt_length: 16, val_max_prompts: 64}
    rollout: {prompts_per_step: 16, n: 4, batch_size: 16, max_new_tokens: 4, val_temperature: 0.0}
    agent:
      harness: verifiers
      max_episode_tokens: 64
      verifiers:
        env: examples/verifiers_env.py
        kwargs: {taskset: {num_tasks: 2000}, agent: {runtime: {type: subprocess}}}
        eval_kwargs: {taskset: {split: val, num_tasks: 200}}

(docs/agents.md, "verifiers environments"; tests/test_agents_verifiers.py trains it.)
"""
import json
import ssl

import httpx
import verifiers.v1 as vf
from openai import AsyncOpenAI

from phaserl.world import prepare_tiny_world

TLS = ssl.create_default_context()  # made once: loading the CA bundle for every episode's client is slow

class ArithData(vf.TaskData):
    answer: str


class ArithTask(vf.Task[ArithData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == self.data.answer)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class ArithConfig(vf.TasksetConfig):
    split: str = "train"
    num_tasks: int = 64


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self):
        world = prepare_tiny_world()
        with open(world.train_file if self.config.split == "train" else world.val_file) as f:
            rows = [json.loads(line) for line in f][: self.config.num_tasks]
        return [ArithTask(ArithData(prompt=r["prompt"][0]["content"], answer=r["reward_model"]["ground_truth"]),
                          self.config.task) for r in rows]


class StreamingChat(vf.Harness[vf.HarnessConfig]):
    """One streamed chat request; its reply is the answer."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0,
                             http_client=httpx.AsyncClient(verify=TLS, timeout=None))
        try:
            stream = await client.chat.completions.create(model=ctx.model, stream=True,
                                                          stream_options={"include_usage": True},
                                                          messages=[{"role": "user", "content": data.prompt}])
            async for _ in stream:
                pass
        finally:
            await client.close()
        return vf.ProgramResult(0, "", "")


__all__ = ["ArithTaskset", "StreamingChat"]
