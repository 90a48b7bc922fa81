//! One test per rule on hosts, names, models, groups and shards, with the helpers of
//! [`super`].

#[allow(clippy::wildcard_imports)]
use super::*;

#[test]
fn referenced_hosts_must_exist() {
    let e = assert_one("host = \"b\"", 0, "host = \"c\"", "unknown-host");
    assert_eq!(e.message(), "group g rank 1: host `c` is not defined");
    assert!(
        e.change().ends_with("or use one of: a, b"),
        "{}",
        e.change()
    );
    assert_one("host = \"a\"", 0, "host = \"z\"", "unknown-host");
}

#[test]
fn names_are_valid_and_unique() {
    let text = format!("{BASE}\n[[host]]\nname = \"b\"\naddress = \"10.0.0.3\"\n");
    assert_eq!(
        errors(&text),
        vec![(line_of(&text, "name = \"b\"", 1), "duplicate-name")]
    );
    assert_one("name = \"g\"", 0, "name = \"g g\"", "bad-name");
    let text = format!("{BASE}\n[[model]]\nname = \"m\"\npath = \"other\"\n");
    assert_eq!(
        errors(&text),
        vec![(line_of(&text, "name = \"m\"", 1), "duplicate-name")]
    );
    let group = BASE[BASE.find("[[group]]").unwrap_or(0)..].replace("port = 7100", "port = 7200");
    let text = format!("{BASE}\n{group}");
    assert_eq!(
        errors(&text),
        vec![(line_of(&text, "name = \"g\"", 1), "duplicate-name")]
    );
}

#[test]
fn models_are_checked() {
    assert_one(
        "path = \"models/m\"",
        0,
        "path = \"models/m\"\ndtype = \"int4\"",
        "bad-dtype",
    );
    assert_one("path = \"models/m\"", 0, "path = \"\"", "empty-path");
    let e = assert_one("model = \"m\"", 0, "model = \"llama\"", "unknown-model");
    assert!(e.change().ends_with("or use one of: m"), "{}", e.change());
    let t = valid(&edit(
        "path = \"models/m\"",
        0,
        "path = \"/w/m.GGUF\"\ndtype = \"bf16\"",
    ));
    let m = t.model("m").expect("model");
    assert_eq!((m.format, m.dtype), (ModelFormat::Gguf, ModelDtype::Bf16));
    assert_eq!(m.path, PathBuf::from("/w/m.GGUF"));

    let unused = valid(&format!(
        "{BASE}\n[[model]]\nname = \"spare\"\npath = \"s\"\n"
    ));
    let w: Vec<_> = unused
        .warnings()
        .iter()
        .map(|i| (i.class(), i.severity))
        .collect();
    assert_eq!(w, vec![("unused-model", Severity::Warning)]);
}

#[test]
fn tp_matches_the_shard_entries() {
    assert_one("tp = 2", 0, "tp = 0", "tp-range");
    assert_one("tp = 2", 0, "tp = -1", "tp-range");
    let e = assert_one("tp = 2", 0, "tp = 3", "shard-count");
    assert_eq!(
        e.message(),
        "group g: tp = 3 but the group has 2 [[group.shard]] entries"
    );
    assert!(
        e.change().ends_with("ranks 0 to 2 (missing: 2)"),
        "{}",
        e.change()
    );
    let e = assert_one("rank = 1", 0, "rank = 2", "rank-range");
    assert_eq!(e.message(), "group g: rank 2 is outside 0..2");
    assert_one("rank = 1", 0, "rank = -1", "rank-range");
    let e = assert_one("rank = 1", 0, "rank = 0", "duplicate-rank");
    assert!(e.message().contains("first at line 25"), "{}", e.message());
    // Ranks may be listed in any order.
    let swapped = BASE
        .replace("rank = 0", "rank = X")
        .replace("rank = 1", "rank = 0")
        .replace("rank = X", "rank = 1");
    let t = valid(&swapped);
    let g = t.group("g").expect("group");
    assert_eq!(g.shards[0].host, "b");
    assert_eq!(g.shards[0].rank.0, 0);
}

#[test]
fn devices_and_collectives_are_checked() {
    let e = assert_one("device = \"cpu\"", 0, "device = \"gpu0\"", "bad-device");
    assert!(e.change().contains("cuda:N"));
    assert_one(
        "device = \"cpu\"",
        1,
        "device = \"cuda:1\"",
        "mixed-devices",
    );
    assert_one(
        "tp = 2",
        0,
        "tp = 2\ncollective = \"mpi\"",
        "bad-collective",
    );
    let e = assert_one("tp = 2", 0, "tp = 2\nprecision = \"int4\"", "bad-precision");
    assert!(e.change().contains("\"exact\"") && e.change().contains("\"fast\""));
    assert_one(
        "tp = 2",
        0,
        "tp = 2\ncollective = \"nccl\"",
        "collective-device",
    );
    assert_one(
        "tp = 2",
        0,
        "tp = 2\ncollective = \"shm\"",
        "shm-across-hosts",
    );
    let t = valid(&edit("tp = 2", 0, "tp = 2\ncollective = \"tcp\""));
    assert_eq!(t.groups[0].requested_collective, CollectiveChoice::Tcp);
    // cuda shards may use a CPU collective (staged through host memory).
    let cuda = BASE.replace("device = \"cpu\"", "device = \"cuda:0\"");
    let text = cuda.replacen("tp = 2", "tp = 2\ncollective = \"tcp\"", 1);
    assert_eq!(valid(&text).groups[0].collective, Collective::Tcp);
}

#[test]
fn a_dtype_that_cuda_shards_cannot_hold_is_refused_at_the_group() {
    // Ranks on two hosts, each on its own GPU: nothing else is wrong.
    let cuda = BASE.replace("device = \"cpu\"", "device = \"cuda:0\"");
    let dtype = "f16";
    let text = cuda.replacen(
        "path = \"models/m\"",
        &format!("path = \"models/m\"\ndtype = \"{dtype}\""),
        1,
    );
    let all = issues(&text);
    let errs: Vec<_> = all.iter().filter(|i| i.is_error()).collect();
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert_eq!(errs[0].class(), "dtype-device");
    assert_eq!(errs[0].location.line, line_of(&text, "model = \"m\"", 0));
    assert!(
        errs[0]
            .to_string()
            .contains(&format!("dtype = \"{dtype}\"")),
        "{}",
        errs[0]
    );
    assert!(
        errs[0].change().contains("\"bf16\""),
        "{}",
        errs[0].change()
    );
    // f32 is the exact path on a GPU.
    for dtype in ["auto", "bf16", "f32"] {
        let text = cuda.replacen(
            "path = \"models/m\"",
            &format!("path = \"models/m\"\ndtype = \"{dtype}\""),
            1,
        );
        valid(&text);
    }
    // CPU shards hold every dtype.
    valid(&BASE.replacen(
        "path = \"models/m\"",
        "path = \"models/m\"\ndtype = \"f16\"",
        1,
    ));
}

#[test]
fn a_gpu_serves_one_shard() {
    let cuda = BASE.replace("device = \"cpu\"", "device = \"cuda:0\"");
    // Rank 1 moves to host a, same GPU and a different port.
    let text = replace_nth(&cuda, "host = \"b\"", 0, "host = \"a\"");
    let text = replace_nth(&text, "port = 7100", 1, "port = 7101");
    let all: Vec<_> = issues(&text).into_iter().filter(|i| i.is_error()).collect();
    assert_eq!(all.len(), 1, "{all:#?}");
    assert_eq!(all[0].class(), "shared-cuda-device");
    assert_eq!(all[0].location.line, line_of(&text, "cuda:0", 1));
    assert_eq!(
        all[0].message(),
        "host a: cuda:0 is used by both group g rank 0 and group g rank 1"
    );
    valid(
        &text
            .replacen("cuda:0", "cuda:1", 2)
            .replacen("cuda:1", "cuda:0", 1),
    );
    // Ranks whose collective goes through host memory may share the GPU (tp > 1 on one
    // GPU, for tests); NCCL (the default on cuda) may not.
    let shared = text.replacen("tp = 2", "tp = 2\ncollective = \"shm\"", 1);
    assert_eq!(valid(&shared).groups[0].collective, Collective::Shm);
    let nccl = text.replacen("tp = 2", "tp = 2\ncollective = \"nccl\"", 1);
    assert_eq!(errors(&nccl).len(), 1, "{:?}", errors(&nccl));
}

#[test]
fn shard_values_are_checked() {
    assert_one(
        "port = 7100",
        0,
        "threads = 0\nport = 7100",
        "threads-range",
    );
    assert_one("port = 7100", 0, "port = 0", "port-range");
    assert_one("port = 7100", 0, "port = 70000", "port-range");
    let e = assert_one("kv_memory = \"1GiB\"", 0, "kv_memory = \"1GB\"", "bad-size");
    assert!(e.message().contains("write GiB"), "{}", e.message());
    assert_one(
        "kv_memory = \"1GiB\"",
        0,
        "kv_memory = \"0MiB\"",
        "zero-kv-memory",
    );
    assert_one("kv_memory = \"1GiB\"", 0, "kv_memory = -5", "bad-size");
    let t = valid(&edit("kv_memory = \"1GiB\"", 0, "kv_memory = 4096"));
    assert_eq!(t.groups[0].shards[0].kv_memory_bytes, 4096);
}

#[test]
fn all_errors_are_reported_at_once_in_file_order() {
    let text = BASE
        .replace("id = 1", "id = 0")
        .replace("address = \"10.0.0.2\"", "address = \"\"")
        .replace("tp = 2", "tp = 2\ncollective = \"mpi\"")
        .replacen("device = \"cpu\"", "device = \"tpu\"", 1)
        .replace("kv_memory = \"1GiB\"\n\n", "kv_memory = \"lots\"\n\n");
    let errs = errors(&text);
    let classes: Vec<_> = errs.iter().map(|(_, c)| *c).collect();
    assert_eq!(
        classes,
        vec![
            "peer-id-range",
            "bad-address",
            "bad-collective",
            "bad-device",
            "bad-size"
        ]
    );
    let mut lines: Vec<_> = errs.iter().map(|(l, _)| *l).collect();
    assert_eq!(lines[0], 2);
    let sorted = {
        lines.sort_unstable();
        lines.clone()
    };
    assert_eq!(lines, sorted);
}

#[test]
fn a_cluster_without_groups_is_valid_with_a_warning() {
    let text = &BASE[..BASE.find("[[model]]").unwrap_or(0)];
    let t = valid(text);
    let w: Vec<_> = t.warnings().iter().map(TopologyIssue::class).collect();
    assert_eq!(w, vec!["no-groups", "unused-host"]);
}

#[test]
fn check_model_reports_tp_problems_at_the_tp_line() {
    let text = edit("tp = 2", 0, "tp = 3").replacen(
        "[[group.shard]]",
        "[[group.shard]]\nrank = 2\nhost = \"a\"\ndevice = \"cpu\"\nport = 7102\nkv_memory = \"1GiB\"\n\n[[group.shard]]",
        1,
    );
    let t = valid(&text);
    let llama = ModelShape {
        num_attention_heads: 32,
        num_key_value_heads: 8,
        intermediate_size: 14336,
        vocab_size: 128256,
        hidden_size: 4096,
        num_hidden_layers: 32,
    };
    let found = t.check_model("m", &llama);
    let classes: Vec<_> = found.iter().map(TopologyIssue::class).collect();
    assert_eq!(classes, vec!["tp-heads", "tp-kv-heads", "tp-mlp-rows"]);
    assert_eq!(
        found[0].message(),
        "group g (model m): tp = 3 does not divide num_attention_heads = 32"
    );
    assert!(
        found[0]
            .change()
            .starts_with("use a tp that divides 32 (1, 2, 4, 8, 16, 32)"),
        "{}",
        found[0].change()
    );
    assert_eq!(found[0].location.line, line_of(&text, "tp = 3", 0));
    assert_eq!(found[0].field, "group[0].tp");
    assert_eq!(found[0].to_string().split(':').next(), Some("conf/t.toml"));
    assert!(t.check_model("other", &llama).is_empty());
    assert!(valid(BASE).check_model("m", &llama).is_empty());
    let plan = t.groups[0].plan(&llama);
    assert!(plan.is_err());
}

#[test]
fn model_issues_point_at_the_path_key() {
    let t = valid(BASE);
    let model = t.model("m").expect("model");
    let issue = t.model_issue(
        model,
        Severity::Warning,
        TopologyError::ModelMissing {
            model: "m".into(),
            path: model.path.display().to_string(),
        },
    );
    assert_eq!(issue.location.line, line_of(BASE, "path = ", 0));
    assert_eq!(issue.field, "model[0].path");
    assert_eq!(issue.class(), "model-missing");
}

#[test]
fn from_spec_validates_a_spec_read_with_plain_serde() {
    let spec: crate::TopologySpec = toml::from_str(BASE).expect("spec");
    let source = crate::Source::new(Path::new("x/t.toml"), BASE);
    let t = Topology::from_spec(&spec, &source).expect("valid");
    assert_eq!(
        t.coordinators[0].data_dir,
        PathBuf::from("x/run/coordinator-1")
    );
    let moved = crate::Source::new(Path::new("t.toml"), BASE).with_base_dir(Path::new("/srv"));
    let t = Topology::from_spec(&spec, &moved).expect("valid");
    assert_eq!(t.models[0].path, PathBuf::from("/srv/models/m"));
}

#[test]
fn json_of_a_topology_and_an_issue() {
    let t = valid(BASE);
    let json = serde_json::to_value(&t).expect("json");
    assert_eq!(json["groups"][0]["collective"], "tcp");
    assert_eq!(json["groups"][0]["shards"][1]["device"], "cpu");
    assert_eq!(json["coordinators"][0]["quic"], "10.0.0.1:7000");
    let issue = &issues(&edit("tp = 2", 0, "tp = 0"))[0];
    let json = serde_json::to_value(issue).expect("json");
    assert_eq!(json["class"], "tp-range");
    assert_eq!(json["line"], 22);
    assert_eq!(json["field"], "group[0].tp");
    assert_eq!(json["severity"], "error");
    assert!(
        json["change"]
            .as_str()
            .is_some_and(|c| c.starts_with("set tp"))
    );
}
