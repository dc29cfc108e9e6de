# composer-core: the two console scripts answer --help, and `import composer_core` imports nothing
# beyond its declared dependencies (+ what those depend on), even with its extras installed.
import re

installed_from_wheel("composer-core", "composer_core")
for script in ("composer-replay", "composer-bypass"):
    out = run(BIN / script, "--help", timeout=300)
    assert f"usage: {script}" in out, out[-2000:]
    print(f"ok: {script} --help")


def _name(req: str) -> str:
    return re.sub(r"[-_.]+", "-", re.split(r"[\s<>=!~;\[(@]", req.strip(), maxsplit=1)[0]).lower()


def _closure(roots: set[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [
            _name(r) for r in reqs if "extra ==" not in r.replace('"', "'").replace("extra==", "extra ==")
        ]
    return seen


declared = {_name(r) for r in metadata.requires("composer-core") or [] if "extra ==" not in r}
allowed = _closure(declared) | {"composer-core"}
probe = "import composer_core, sys, json; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
modules = json.loads(run(sys.executable, "-I", "-c", probe).strip().splitlines()[-1])
owners = {m: {_name(d) for d in ds} for m, ds in metadata.packages_distributions().items()}
stdlib = set(sys.stdlib_module_names) | set(sys.builtin_module_names)
foreign = {}
for mod in modules:
    if mod in stdlib or mod in ("__main__", "__mp_main__"):  # the latter: multiprocessing's alias of __main__
        continue
    dists = owners.get(mod)
    if not dists:
        foreign[mod] = "no installed distribution"
    elif not dists & allowed:
        foreign[mod] = ", ".join(sorted(dists))
assert not foreign, f"import composer_core pulled in modules outside its declared dependencies: {foreign}"
extras_present = sorted(
    d
    for d in ("transformers", "httpx", "tokenizers", "pyarrow")
    if _name(d) not in allowed and d in {_name(x.metadata["Name"]) for x in metadata.distributions()}
)
assert extras_present, "the extras are not installed, so the import check would prove nothing"
third_party = sorted(m for m in modules if m not in stdlib and m not in ("__main__", "__mp_main__"))
print(
    f"ok: import composer_core imports {len(third_party)} non-stdlib top-level modules ({', '.join(third_party)}),"
)
print(
    f"    all from its declared dependencies {sorted(declared)} and theirs; installed but not imported: {extras_present}"
)
