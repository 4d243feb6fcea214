#!/usr/bin/env python3
"""The module graph of a Rust crate's `src/`, from its `crate::`, `super::` and `self::` paths, and
its import circles (strongly connected components of more than one module).

    scripts/module-graph.py [SRC_DIR] [--edges] [--depth N]

SRC_DIR defaults to sidecar/src. A module is a file (`a/b.rs` or `a/b/mod.rs` is `a::b`); `lib.rs`
is the crate root and is left out (it declares and wires the modules). Binaries (`main.rs`,
`bin/`) are not part of the library. Every reference counts, in `use` lines and inline paths,
tests included. `--depth 1` folds modules into their top-level folder (the "planes"), which shows
the dependencies between folders. Exits 1 when there is a circle.
"""

import re
import sys
from pathlib import Path


def modules(src: Path) -> dict:
    out = {}
    for f in sorted(src.rglob("*.rs")):
        rel = f.relative_to(src)
        if rel.parts[0] == "bin" or rel.as_posix() in ("main.rs", "lib.rs"):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "mod":
            parts = parts[:-1]
        out["::".join(parts)] = f
    return out


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(re.sub(r"//.*", "", line) for line in text.splitlines())


def expand_use(tree: str) -> list:
    """`a::{b, c::{d, e}}` → [`a::b`, `a::c::d`, `a::c::e`] (a tree without braces is itself)."""
    tree = tree.strip()
    m = re.match(r"^(.*?)::\{(.*)\}$", tree, flags=re.S)
    if not m:
        return [tree]
    prefix, inner = m.group(1), m.group(2)
    items, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    return [p for it in items if it.strip() for p in expand_use(prefix + "::" + it.strip())]


def references(text: str, here: str) -> set:
    """Absolute paths (`crate::…` with `crate::` dropped) this module's text names."""
    text = strip_comments(text)
    paths = []
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        paths += [p for p in expand_use(m.group(1)) if re.match(r"^(crate|super|self)::", p)]
    paths += re.findall(r"\b(?:crate|super)(?:::[A-Za-z_][A-Za-z0-9_]*)+", text)
    out = set()
    for p in paths:
        p = re.sub(r"\s+as\s+\w+$", "", p.strip())
        segs = p.split("::")
        base = here.split("::") if here else []
        if segs[0] == "crate":
            segs = segs[1:]
        else:
            # `self::` inside a file module is that module; every `super::` goes one level up
            while segs and segs[0] in ("super", "self"):
                if segs[0] == "super":
                    base = base[:-1]
                segs = segs[1:]
            segs = base + segs
        out.add("::".join(s for s in segs if s not in ("self", "*")))
    return out


def resolve(path: str, mods: dict):
    """The longest module that is a prefix of `path`."""
    segs = path.split("::")
    for n in range(len(segs), 0, -1):
        cand = "::".join(segs[:n])
        if cand in mods:
            return cand
    return None


def graph(src: Path, depth: int = 0) -> dict:
    mods = modules(src)
    fold = (lambda m: "::".join(m.split("::")[:depth])) if depth else (lambda m: m)
    edges = {fold(m): set() for m in mods}
    for m, f in mods.items():
        for ref in references(f.read_text(), m):
            target = resolve(ref, mods)
            if target is None:
                continue
            a, b = fold(m), fold(target)
            # a module using its own children (or a folder its own files) is not an edge
            if a != b and not b.startswith(a + "::"):
                edges[a].add(b)
    return edges


def circles(edges: dict) -> list:
    """Tarjan's strongly connected components with more than one node."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main():
    args = sys.argv[1:]
    show_edges = "--edges" in args
    depth = 0
    if "--depth" in args:
        depth = int(args[args.index("--depth") + 1])
        del args[args.index("--depth") : args.index("--depth") + 2]
    rest = [a for a in args if not a.startswith("--")]
    src = Path(rest[0] if rest else "sidecar/src")
    edges = graph(src, depth)
    if show_edges:
        for a in sorted(edges):
            print(f"{a} -> {', '.join(sorted(edges[a])) or '-'}")
    found = circles(edges)
    for c in found:
        print("circle: " + " <-> ".join(c))
    print(f"{len(edges)} modules, {sum(len(v) for v in edges.values())} edges, {len(found)} circle(s)")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
