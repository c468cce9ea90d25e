"""A small synthetic chat set for trying instruction tuning end to end: question/answer conversations
built from the synthetic tasks (fullband.data.synthetic), so that whether the tuned model answers
correctly can be checked exactly. ``scripts/make_chat_data.py`` writes them as .jsonl."""

from __future__ import annotations

import random

from fullband.data.synthetic import final_answer, get_task, synthetic_examples

CHAT_TASKS = ("registers", "flipflop", "summod")
SYSTEM = "You answer puzzles with one short sentence."
# (user question, assistant answer) of the closing turn some conversations get, to teach turn taking.
CLOSINGS = (("Thanks!", "You're welcome."), ("Are you sure?", "Yes."), ("Thank you.", "Glad to help."))


def puzzle_turn(task: str, prompt: str, answer: str) -> tuple[str, str]:
    """The user's question and the assistant's reply for one synthetic example."""
    body = prompt.removeprefix(task if task != "registers" else "regs").strip().removesuffix(":").strip()
    return f"Solve this {task} puzzle: {body}", f"The answer is {final_answer(answer)}."


def synthetic_chat_records(n: int, seed: int = 0, tasks: tuple[str, ...] = CHAT_TASKS) -> list[dict]:
    """``n`` conversations (OpenAI `messages`): an optional system message, one puzzle question and its
    answer, and sometimes a closing exchange. Deterministic in ``seed``."""
    rng = random.Random(seed)
    per_task = {t: iter(synthetic_examples(get_task(t), n, rng.randrange(2**31))) for t in tasks}
    records = []
    for _ in range(n):
        task = rng.choice(tasks)
        example = next(per_task[task])
        question, reply = puzzle_turn(task, example.prompt, example.answer)
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
        if rng.random() < 0.3:
            closing, answer = rng.choice(CLOSINGS)
            messages += [{"role": "user", "content": closing}, {"role": "assistant", "content": answer}]
        records.append({"messages": messages})
    return records

