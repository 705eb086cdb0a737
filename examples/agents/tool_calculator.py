"""The built-in calculator task (`data.task: tool_calculator`) as an agent on the OpenAI API: the model calls the
calculator, the agent runs it and sends the result back as a `tool` message, the model answers "#### <number>".

    hybridflow train examples/tool_calculator.yaml model.path=tests/assets/sft_tool_calculator \
        rollout.multi_turn.enable=false rollout.agent.mode=server rollout.agent.path=examples/agents/tool_calculator.py

The task's exact-answer reward scores the trajectory (the agent returns no reward of its own).
"""

import json

from hybridflow.agentic.agents import AgentResult
from hybridflow.agentic.tools import CalculatorTool, ToolContext

CALCULATOR = CalculatorTool()
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": CALCULATOR.description,
                                           "parameters": CALCULATOR.parameters}}]


async def run(client, sample):
    messages = [dict(m) for m in sample["raw_prompt"]]  # [{"role": "user", "content": "What is 408*99?"}]
    for _ in range(2):  # call, then answer
        r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = r.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            result = CALCULATOR.execute(json.loads(call.function.arguments), ToolContext("agent"))
            # the model learnt tool results as a user turn (`hermes_plain`); a template with a `tool` role (Qwen2.5,
            # the built-in one since) takes {"role": "tool", "tool_call_id": call.id, "content": result.text}
            messages.append({"role": "user", "content": f"<tool_response>{result.text}</tool_response>"})
    return AgentResult(messages=messages)
