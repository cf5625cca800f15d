"""Reading a generated program's source (src/programN.cpp or .cu) by its functions.

The generated step is split into functions: `step`, `evaluate`, `forward` (which both call),
`forwardBackward` (the CUDA target's captured part) and one function per repeated layer
(`layer_h_forward`, ...), called once per layer. A check of what a step does must follow the
calls: `reach` gives the text a function runs, `step_count` how often a step runs a statement.
"""
import re

_FUNCTION = re.compile(r"^void (\w+)\(StepContext &ctx[^)]*\) \{\n(.*?)^\}", re.M | re.S)


def bodies(src):
    """{name: body} of the source's functions that take the StepContext."""
    return dict(_FUNCTION.findall(src))


def _calls(body, callee):
    return len(re.findall(r"\b%s\(ctx[,)]" % re.escape(callee), body))


def reach(src, fn):
    """The body of `fn` followed by the bodies of every function it calls, transitively."""
    funcs = bodies(src)
    seen, order = set(), []

    def visit(name):
        if name in seen:
            return
        seen.add(name)
        order.append(name)
        for callee in funcs:
            if callee != name and _calls(funcs[name], callee):
                visit(callee)
    visit(fn)
    return "\n".join(funcs[n] for n in order)


def step_count(src, needle, fn="step"):
    """How often one run of `fn` runs `needle`: in its own body and in the functions it
    calls, each as often as it is called."""
    funcs = bodies(src)

    def count(name, depth=0):
        if depth > len(funcs):
            raise ValueError("the functions of the source call each other in a cycle")
        body = funcs[name]
        n = body.count(needle)
        for callee in funcs:
            calls = _calls(body, callee) if callee != name else 0
            if calls:
                n += calls * count(callee, depth + 1)
        return n
    return count(fn)
