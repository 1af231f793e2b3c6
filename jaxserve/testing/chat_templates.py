"""Chat templates for test models that ship none, written from the behaviour of the originals.

QWEN3: ChatML turns (`<|im_start|>role\\n...<|im_end|>\\n`) as Qwen3's template renders them:
- `tools` described in the system turn (after the system message's own text), each as JSON,
  with the `<tool_call>` form to answer in;
- an assistant turn after the last user query shows its reasoning (`reasoning_content`, or the
  `<think>` block its content starts with) as `<think>\\n...\\n</think>\\n\\n`; earlier turns
  drop it; its tool calls follow as `<tool_call>` blocks;
- a run of tool results is one user turn of `<tool_response>` blocks;
- the generation prompt opens the assistant turn, and with `enable_thinking` false writes an
  empty think block, so the model answers without reasoning.
"""

# Written with explicit strings: Hugging Face renders templates with trim_blocks and
# lstrip_blocks, which eat the newlines around block tags.
QWEN3 = r"""
{%- macro turn(role, text) %}
  {{- '<|im_start|>' + role + '\n' + text + '<|im_end|>\n' }}
{%- endmacro %}
{%- set nl = '\n' %}
{%- set first_system = messages and messages[0].role == 'system' %}
{%- if tools %}
  {%- set intro = (messages[0].content + nl + nl) if first_system else '' %}
  {{- '<|im_start|>system\n' + intro + '# Tools\n\nThe functions you can call, between <tools> and '
      + '</tools>:\n<tools>' }}
  {%- for tool in tools %}{{ nl + (tool | tojson) }}{% endfor %}
  {{- '\n</tools>\n\nCall one by writing its name and arguments as JSON between <tool_call> and '
      + '</tool_call>:\n<tool_call>\n{"name": <name>, "arguments": <JSON object>}\n'
      + '</tool_call><|im_end|>\n' }}
{%- elif first_system %}
  {{- turn('system', messages[0].content) }}
{%- endif %}
{%- set state = namespace(last_query=messages | length - 1, searching=true) %}
{%- for m in messages | reverse %}
  {%- if state.searching and m.role == 'user' and m.content is string
        and not (m.content.startswith('<tool_response>')
                 and m.content.endswith('</tool_response>')) %}
    {%- set state.searching = false %}
    {%- set state.last_query = messages | length - 1 - loop.index0 %}
  {%- endif %}
{%- endfor %}
{%- for m in messages %}
  {%- set text = m.content if m.content is string else '' %}
  {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
    {{- turn(m.role, text) }}
  {%- elif m.role == 'assistant' %}
    {%- set thought = '' %}
    {%- if m.reasoning_content is string %}
      {%- set thought = m.reasoning_content %}
    {%- elif '</think>' in text %}
      {%- set thought = text.split('</think>')[0].split('<think>')[-1].strip(nl) %}
      {%- set text = text.split('</think>')[-1].lstrip(nl) %}
    {%- endif %}
    {{- '<|im_start|>assistant\n' }}
    {%- if loop.index0 > state.last_query and (loop.last or thought) %}
      {{- '<think>\n' + thought.strip(nl) + '\n</think>\n\n' + text.lstrip(nl) }}
    {%- else %}
      {{- text }}
    {%- endif %}
    {%- for call in m.tool_calls or [] %}
      {%- set fn = call.function if call.function is defined else call %}
      {%- set args = fn.arguments if fn.arguments is string else fn.arguments | tojson %}
      {{- nl if (text or not loop.first) else '' }}
      {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' + args + '}\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
  {%- elif m.role == 'tool' %}
    {%- if loop.first or loop.previtem.role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
    {{- '\n<tool_response>\n' + text + '\n</tool_response>' }}
    {%- if loop.last or loop.nextitem.role != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|im_start|>assistant\n' }}
  {%- if enable_thinking is defined and enable_thinking is false %}
    {{- '<think>\n\n</think>\n\n' }}
  {%- endif %}
{%- endif %}
"""
