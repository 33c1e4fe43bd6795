"""Thin adapters from other ecosystems to phaserl's Environment and reward conventions.

    reasoning_gym.py  reasoning-gym datasets: verl-schema rows (`records`), a rule reward (`score`) and a
                      retry environment (`ReasoningGymEnvironment`), all scoring with the dataset's score_answer
    gym.py            Gym-style text environments (GEM, Gymnasium text envs): reset()/step(str) -> GymEnvironment
    openenv.py        OpenEnv environments, in-process or through their client -> OpenEnvEnvironment
    textarena.py      TextArena games, one player trained, the others fixed opponents -> TextArenaEnvironment
    verifiers.py      verifiers environments run as they are (agent.harness: verifiers): loading, tasks as
                      rows, episodes through the endpoint (the trainer's side: trainer/harness_phase.py)

Each imports its package only when used; install them with `pip install "phaserl[agents]"` (or one
by one: reasoning-gym, gem-llm, openenv), "phaserl[textarena]" and "phaserl[verifiers]". Nothing here
downloads data: reasoning-gym generates rows, TextArena games their boards.
"""
