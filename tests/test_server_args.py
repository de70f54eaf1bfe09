"""pyspec-server's command line (pyspec/server/args.py): llama-server's flags, env vars, rules."""

import os

import pytest

from pyspec.server.args import (ArgError, ServerConfig, _INDEX, _REMOVED, _UNSUPPORTED,
                                format_help, parse_args)


def parse(*argv, env=None):
    return parse_args(list(argv), env or {})


def test_defaults_are_llama_servers():
    c = parse()
    assert c == ServerConfig()
    assert (c.model, c.hf_repo, c.model_draft, c.spec_type, c.spec_verify) == (None,) * 5
    assert (c.ctx_size, c.n_predict, c.batch_size, c.ubatch_size, c.parallel) == \
        (0, -1, 2048, 512, -1)
    assert (c.host, c.port, c.timeout, c.cors_origins) == ("127.0.0.1", 8080, 3600, "*")
    assert (c.temp, c.top_k, c.top_p, c.min_p, c.seed) == (0.8, 40, 0.95, 0.05, -1)
    assert (c.repeat_last_n, c.repeat_penalty, c.presence_penalty, c.frequency_penalty) == \
        (64, 1.0, 0.0, 0.0)
    assert (c.spec_draft_n_max, c.spec_draft_n_min, c.spec_draft_p_min) == (None, 0, 0.0)
    assert c.slots and c.jinja and c.cache_prompt and c.cont_batching
    assert not (c.metrics or c.props or c.offline or c.verbose)
    assert c.kv_unified is None and c.api_keys == [] and c.alias == [] and c.warnings == []


@pytest.mark.parametrize("short,long,field,text,value", [
    ("-m", "--model", "model", "a.gguf", "a.gguf"),
    ("-hf", "--hf-repo", "hf_repo", "u/m:Q4_0", "u/m:Q4_0"),
    ("-hfr", "--hf-repo", "hf_repo", "u/m", "u/m"),
    ("-hfd", "--spec-draft-hf", "hf_repo_draft", "u/d", "u/d"),
    ("-md", "--spec-draft-model", "model_draft", "d.gguf", "d.gguf"),
    ("-c", "--ctx-size", "ctx_size", "512", 512),
    ("-n", "--predict", "n_predict", "7", 7),
    ("-n", "--n-predict", "n_predict", "7", 7),
    ("-b", "--batch-size", "batch_size", "64", 64),
    ("-ub", "--ubatch-size", "ubatch_size", "32", 32),
    ("-np", "--parallel", "parallel", "2", 2),
    ("-t", "--threads", "threads", "3", 3),
    ("-tb", "--threads-batch", "threads_batch", "5", 5),
    ("-a", "--alias", "alias", "x,y", ["x", "y"]),
    ("-s", "--seed", "seed", "42", 42),
    ("-to", "--timeout", "timeout", "5", 5),
    ("-ngl", "--n-gpu-layers", "n_gpu_layers", "all", "all"),
    ("-ctk", "--cache-type-k", "cache_type_k", "f16", "f16"),
])
def test_short_and_long_forms(short, long, field, text, value):
    assert getattr(parse(short, text), field) == value
    assert getattr(parse(long, text), field) == value


def test_flags_and_their_negatives():
    assert not parse("--no-slots").slots and parse("--slots").slots
    assert not parse("--no-jinja").jinja
    assert parse("-kvu").kv_unified is True and parse("--no-kv-unified").kv_unified is False
    assert not parse("--no-cache-prompt").cache_prompt
    assert parse("--metrics", "--props", "--offline", "-v").metrics
    c = parse("-nocb")
    assert not c.cont_batching and any("--no-cont-batching" in w for w in c.warnings)


def test_values_may_look_like_options_and_use_equals():
    c = parse("--seed", "-1", "--temp", "-0.5", "--port=9090", "--n_predict=4")
    assert (c.seed, c.temp, c.port, c.n_predict) == (-1, -0.5, 9090, 4)


def test_underscores_in_long_option_names_only():
    c = parse("--n_predict", "5", "--ctx_size", "256", "--chat_template", "a_b", "--no_slots")
    assert (c.n_predict, c.ctx_size, c.chat_template, c.slots) == (5, 256, "a_b", False)
    with pytest.raises(ArgError):
        parse("-n_p", "5")  # short options are not normalised


def test_env_sets_options_and_command_line_wins():
    env = {"LLAMA_ARG_PORT": "9000", "LLAMA_ARG_CTX_SIZE": "1024", "LLAMA_API_KEY": "k1,k2",
           "LLAMA_ARG_ALIAS": "a", "LLAMA_ARG_MODEL": "env.gguf", "HF_TOKEN": "t"}
    c = parse(env=env)
    assert (c.port, c.ctx_size, c.api_keys, c.alias, c.model, c.hf_token) == \
        (9000, 1024, ["k1", "k2"], ["a"], "env.gguf", "t")
    c = parse("--port", "8081", "-m", "cli.gguf", "--api-key", "k3", env=env)
    assert (c.port, c.model, c.api_keys, c.ctx_size) == (8081, "cli.gguf", ["k3"], 1024)


def test_seed_has_no_env_var():
    assert parse(env={"LLAMA_ARG_SEED": "5"}).seed == -1


@pytest.mark.parametrize("text,value", [
    ("on", True), ("enabled", True), ("true", True), ("1", True),
    ("off", False), ("disabled", False), ("false", False), ("0", False)])
def test_boolean_env_values(text, value):
    c = parse(env={"LLAMA_ARG_ENDPOINT_METRICS": text, "LLAMA_ARG_ENDPOINT_SLOTS": text,
                   "LLAMA_ARG_KV_UNIFIED": text})
    assert c.metrics is value and c.slots is value and c.kv_unified is value


def test_boolean_env_bad_value_names_the_variable():
    with pytest.raises(ArgError, match="LLAMA_ARG_JINJA"):
        parse(env={"LLAMA_ARG_JINJA": "yes"})


def test_negative_flag_on_command_line_beats_env():
    assert not parse("--no-slots", env={"LLAMA_ARG_ENDPOINT_SLOTS": "1"}).slots
    assert parse("--jinja", env={"LLAMA_ARG_JINJA": "off"}).jinja


def test_unknown_flag():
    with pytest.raises(ArgError, match="^invalid argument: --frobnicate$"):
        parse("--frobnicate")
    with pytest.raises(ArgError, match="invalid argument: positional"):
        parse("positional")


@pytest.mark.parametrize("argv,flag", [
    (["--embedding"], "--embedding"), (["--reranking"], "--reranking"),
    (["--lora", "x.gguf"], "--lora"), (["--grammar-file", "g"], "--grammar-file"),
    (["--context-shift"], "--context-shift"), (["--mmproj", "p"], "--mmproj"),
    (["--slot-save-path", "d"], "--slot-save-path"), (["--samplers", "top_k"], "--samplers"),
    (["--mirostat", "2"], "--mirostat"), (["--dry-multiplier", "1"], "--dry-multiplier"),
    (["--xtc-probability", "1"], "--xtc-probability"), (["--api-prefix", "/x"], "--api-prefix"),
    (["--path", "d"], "--path"), (["--pooling", "mean"], "--pooling"),
    (["--spec-type", "draft-simple"], "--spec-type draft-simple"),
    (["--spec-type", "ngram-mod"], "--spec-type ngram-mod"),
    (["-ctk", "q8_0"], "-ctk q8_0"),
    (["--reasoning-format", "deepseek"], "--reasoning-format deepseek"),
])
def test_unsupported_flags_name_themselves(argv, flag):
    with pytest.raises(ArgError) as err:
        parse(*argv)
    assert flag in str(err.value) and "not supported yet" in str(err.value)


def test_unsupported_env_enabled_is_an_error_disabled_is_fine():
    with pytest.raises(ArgError, match="LLAMA_ARG_EMBEDDINGS"):
        parse(env={"LLAMA_ARG_EMBEDDINGS": "1"})
    parse(env={"LLAMA_ARG_EMBEDDINGS": "off"})


@pytest.mark.parametrize("argv", [
    ["--mlock"], ["--no-mmap"], ["-fa", "on"], ["--flash-attn", "auto"], ["--threads-http", "4"],
    ["--no-ui"], ["--no-webui"], ["-cram", "0"], ["--numa", "distribute"],
    ["-dev", "none"], ["--log-disable"], ["--no-models-autoload"], ["--swa-full"],
    ["--sleep-idle-seconds", "5"], ["--backend_sampling"], ["--no-context-shift"]])
def test_hardware_flags_are_accepted_with_a_warning(argv):
    c = parse(*argv, "--port", "1234")
    assert c.port == 1234   # a value-taking ignored flag consumed exactly its value
    assert len(c.warnings) == 1
    assert c.warnings[0].startswith(f"flag {argv[0].replace('_', '-')} is accepted and ignored: ")


def test_warmup_is_on_unless_turned_off():
    assert parse().warmup is True and parse("--warmup").warmup is True
    c = parse("--no-warmup")
    assert c.warmup is False and c.warnings == []


def test_mlock_warning_text():
    assert parse("--mlock").warnings[0].startswith("flag --mlock is accepted and ignored: ")


@pytest.mark.parametrize("flag,hint", [("--draft", "--spec-draft-n-max"),
                                       ("--draft-n", "--spec-draft-n-max"),
                                       ("--draft-max", "--spec-draft-n-max"),
                                       ("--draft-min", "--spec-draft-n-min")])
def test_removed_draft_flags(flag, hint):
    with pytest.raises(ArgError, match=f"{flag} has been removed. use {hint}"):
        parse(flag, "4")


def test_harness_flags_are_all_classified():
    # The flags llama.cpp's server test harness passes (reference §2): each is either
    # supported, ignored or explicitly unsupported, never "invalid argument".
    harness = """--port --temp --seed --host --slots --no-slots --jinja --no-jinja --offline --model
    --hf-repo --hf-file --alias --ctx-size --batch-size --parallel --n-predict --ubatch-size
    --threads --n-gpu-layers --cont-batching --embedding --reranking --metrics --kv-unified
    --swa-full --pooling --tags -ctk -ctv -fa --slot-save-path --grp-attn-n --grp-attn-w
    --verbose --lora --context-shift --spec-type --api-key --spec-draft-n-max --spec-draft-n-min
    --spec-synth-len --spec-synth-rates --no-ui --no-models-autoload --reasoning-format
    --reasoning --chat-template --chat-template-file --mmproj-url --no-mmproj --media-path
    --sleep-idle-seconds --cache-ram --no-cache-idle-slots --ui-mcp-proxy --tools
    --tools-runtime --mcp-servers-config --mcp-servers-json --backend-sampling --model-url
    --model-draft --models-dir --models-max --models-preset --cors-origins""".split()
    missing = [f for f in harness if f not in _INDEX and f not in _UNSUPPORTED]
    assert missing == []
    # ... and no spelling sits in two tables.
    assert not set(_INDEX) & set(_UNSUPPORTED)
    assert not set(_REMOVED) & (set(_INDEX) | set(_UNSUPPORTED))


@pytest.mark.parametrize("argv,message", [
    (["-np", "0"], "--parallel"), (["-np", "-3"], "--parallel"),
    (["--port", "-1"], "--port"), (["--port", "70000"], "--port"),
    (["--port", "abc"], "--port"), (["-c", "-5"], "--ctx-size"),
    (["--spec-draft-p-min", "1.5"], "--spec-draft-p-min"),
    (["--spec-draft-p-min", "-0.1"], "--spec-draft-p-min"),
    (["-n", "-2"], "--n-predict"), (["-b", "0"], "--batch-size"),
    (["--seed", "-2"], "--seed"), (["--top-p", "2"], "top_p"),
    (["--temp", "nan"], "--temp"), (["--port"], "--port"),
    (["--metrics=1"], "--metrics"), (["--spec-verify", "fast"], "--spec-verify"),
    (["-m", "m.gguf", "--spec-type", "draft-dflash"], "draft model"),
    (["-ctk", "f32"], "same cache type"),
])
def test_bad_values(argv, message):
    with pytest.raises(ArgError) as err:
        parse(*argv)
    assert message in str(err.value)


def test_spec_options():
    c = parse("-md", "d.gguf", "--spec-type", "draft-dspark", "--spec-draft-n-max", "8",
              "--spec-draft-n-min", "2", "--draft-p-min", "0.3", "--spec-verify", "block")
    assert (c.model_draft, c.spec_type, c.spec_draft_n_max, c.spec_draft_n_min,
            c.spec_draft_p_min, c.spec_verify) == ("d.gguf", "draft-dspark", 8, 2, 0.3, "block")
    assert parse("--spec-type", "none").spec_type == "none"


@pytest.mark.parametrize("argv,spec_type,ngram", [
    ((), None, False),
    (("--spec-type", "ngram-simple"), "none", True),              # no drafter: lookups alone
    (("--spec-type", "ngram-simple", "-md", "d.gguf"), None, True),  # mixed; type from the file
    (("--spec-type", "draft-dspark,ngram-simple"), "draft-dspark", True),
    (("--spec-type", "ngram-simple,draft-dflash", "-md", "d.gguf"), "draft-dflash", True),
    (("--spec-type", "draft-dspark"), "draft-dspark", False),
])
def test_spec_type_lists(argv, spec_type, ngram):
    c = parse(*argv)
    assert (c.spec_type, c.spec_ngram) == (spec_type, ngram)
    assert (c.spec_ngram_size_n, c.spec_ngram_size_m) == (12, 48)   # llama-server's defaults


def test_spec_type_list_errors_and_ngram_sizes():
    c = parse("--spec-type", "ngram-simple", "--spec-ngram-size-n", "3", "--spec-ngram-size-m", "16",
              "--spec-ngram-check-rate", "2", "--spec-ngram-min-hits", "1")
    assert (c.spec_ngram, c.spec_ngram_size_n, c.spec_ngram_size_m) == (True, 3, 16)
    assert any("--spec-ngram-check-rate" in w for w in c.warnings)
    for argv, message in [(("--spec-type", "draft-dspark,draft-dflash"), "several drafter types"),
                          (("--spec-type", "none,ngram-simple"), "cannot be combined"),
                          (("--spec-type", "ngram-mod"), "not supported yet"),
                          (("--spec-type", "ngram-simple", "--spec-ngram-size-n", "0"), "must be >= 1"),
                          (("--spec-type", "ngram-simple", "--spec-ngram-size-m", "0"), "must be >= 1")]:
        with pytest.raises(ArgError, match=message):
            parse(*argv)


def test_kv_cache_types_pass_through():
    c = parse("-ctk", "f32", "-ctv", "f32")
    assert (c.cache_type_k, c.cache_type_v) == ("f32", "f32")


def test_api_key_file(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("one\n\n two \n")
    c = parse("--api-key", "a,b", "--api-key-file", str(keys))
    assert c.api_keys == ["a", "b", "one", "two"]
    assert parse(env={"LLAMA_ARG_API_KEY_FILE": str(keys)}).api_keys == ["one", "two"]
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(ArgError, match="nope.txt"):
        parse("--api-key-file", missing)


def test_threads_at_or_below_zero_mean_all_cores():
    assert parse("-t", "0").threads == -1


@pytest.mark.parametrize("argv,n_ctx_train,layout", [
    (["-c", "2000"], 8192, (4, 2048, True)),
    (["-c", "2000", "-np", "3"], 8192, (3, 768, False)),
    (["-np", "2", "-c", "512"], 8192, (2, 256, False)),
    ([], 8192, (4, 8192, True)),
    (["-kvu", "-np", "2", "-c", "512"], 8192, (2, 512, True)),
    (["-no-kvu"], 8192, (4, 8192, True)),                 # -np auto forces a unified KV
    (["-c", "16384", "-np", "1"], 8192, (1, 8192, False)),  # capped at n_ctx_train
    (["--kv-unified-per-slot", "1024"], 8192, (4, 1024, True)),
])
def test_slot_layout(argv, n_ctx_train, layout):
    assert parse(*argv).slot_layout(n_ctx_train) == layout


def test_model_name():
    assert parse("-a", "tinyllama-2,fim,code", "-m", "m.gguf").model_name() == "code"
    assert parse("-hf", "u/m:Q8_0", "-m", "x.gguf").model_name() == "u/m:Q8_0"
    assert parse("-m", "models/x.gguf").model_name() == "models/x.gguf"
    from pyspec.model import default_model_path
    try:
        default = os.path.basename(default_model_path())
    except RuntimeError:
        pytest.skip("no embedded default model installed")
    assert parse().model_name() == default


def test_help_and_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse("--help")
    assert exit_.value.code == 0 and "--spec-draft-n-max" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        parse("--version")
    assert exit_.value.code == 0 and "pyspec-server" in capsys.readouterr().out
    assert "LLAMA_ARG_PORT" in format_help()


def test_slot_prompt_similarity():
    assert parse_args([], environ={}).slot_prompt_similarity == 0.1
    assert parse_args(["-sps", "0.5"], environ={}).slot_prompt_similarity == 0.5
    assert parse_args(["--slot-prompt-similarity", "0"], environ={}).slot_prompt_similarity == 0.0
    with pytest.raises(ArgError, match="slot-prompt-similarity"):
        parse_args(["-sps", "1.5"], environ={})


def test_the_default_model_comes_with_its_embedded_drafter():
    """No -m / -hf: the default model and, unless --spec-type none or another drafter is named,
    its embedded DSpark drafter with 2 drafts per round (3, llama-server's default, otherwise;
    an explicit --spec-draft-n-max always wins)."""
    from pyspec.model import default_drafter_path, default_model_path
    from pyspec.server.main import default_n_max, resolve_paths

    embedded = default_drafter_path()
    if embedded is None:
        pytest.skip("this install has no embedded drafter")
    c = parse()
    assert resolve_paths(c) == (default_model_path(), embedded, True)
    assert default_n_max(c, True) == 2
    assert resolve_paths(parse("--spec-type", "none")) == (default_model_path(), None, False)
    assert resolve_paths(parse("-md", "d.gguf")) == (default_model_path(), "d.gguf", False)
    assert resolve_paths(parse("-m", "m.gguf")) == ("m.gguf", None, False)
    assert default_n_max(parse("-m", "m.gguf", "-md", "d.gguf"), False) == 3
    assert default_n_max(parse("--spec-draft-n-max", "5"), True) == 5
    # asking for DSpark speculation needs no -md with the default model (its drafter is one)
    assert resolve_paths(parse("--spec-type", "draft-dspark")) == (default_model_path(), embedded, True)
    with pytest.raises(ArgError):
        parse("-m", "m.gguf", "--spec-type", "draft-dspark")


def test_the_embedded_drafter_stays_off_where_it_does_not_pay(monkeypatch):
    """Where the embedded drafter was measured slower than plain decoding (the GPU, CPUs whose
    quantized kernels are not AVX-512 VNNI: pyspec.model.embedded_drafter_by_default), the server
    loads the default model without it unless speculation is asked for (--spec-type draft-dspark,
    --spec-draft-n-max, -ngld). Played on this CPU by declaring no backend the drafter pays on."""
    import pyspec.model
    from pyspec.server.main import Loaded

    if pyspec.model.default_drafter_path() is None:
        pytest.skip("this install has no embedded drafter")
    base = ("-c", "256", "-t", "1", "-np", "1")
    assert (Loaded(parse(*base)).drafter is not None) == pyspec.model.embedded_drafter_by_default("cpu")
    monkeypatch.setattr(pyspec.model, "EMBEDDED_DRAFTER_BACKENDS", ())
    held = Loaded(parse(*base))
    assert held.drafter is None and held.embedded_drafter_held_back and not held.embedded_drafter
    for asked in (("--spec-type", "draft-dspark"), ("--spec-draft-n-max", "2")):
        on = Loaded(parse(*base, *asked))
        assert on.drafter is not None and on.embedded_drafter, asked



@pytest.mark.parametrize("var, bad", [("PYSPEC_SERVER_LOOP", "uv-loop"), ("PYSPEC_SERVER_HTTP", "h2")])
def test_unknown_event_loop_or_http_choice_is_a_clear_error(monkeypatch, capsys, var, bad):
    """PYSPEC_SERVER_LOOP / PYSPEC_SERVER_HTTP (uvicorn's choices, for A/B runs) refuse a value
    uvicorn does not know before anything is loaded, naming the variable and the choices."""
    from pyspec.server.main import main
    monkeypatch.setenv(var, bad)
    assert main(["--port", "0"]) == 1
    err = capsys.readouterr().err
    assert var in err and repr(bad) in err and "auto" in err
