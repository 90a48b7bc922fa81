//! One test per rule: a valid file, changed in one place, must give that rule's error at the
//! line of the change.

use std::path::{Path, PathBuf};

use crate::error::TopologyError;
use crate::issue::{Severity, TopologyIssue};
use crate::plan::ModelShape;
use crate::topology::{Collective, CollectiveChoice, Device, ModelDtype, ModelFormat, Topology};

/// Two hosts, one coordinator, one CPU group with a rank on each host.
const BASE: &str = r#"[[coordinator]]
id = 1
host = "a"
quic = "10.0.0.1:7000"
http = "10.0.0.1:8000"

[[host]]
name = "a"
address = "10.0.0.1"

[[host]]
name = "b"
address = "10.0.0.2"

[[model]]
name = "m"
path = "models/m"

[[group]]
name = "g"
model = "m"
tp = 2

[[group.shard]]
rank = 0
host = "a"
device = "cpu"
port = 7100
kv_memory = "1GiB"

[[group.shard]]
rank = 1
host = "b"
device = "cpu"
port = 7100
kv_memory = "1GiB"
"#;

fn parse(text: &str) -> Result<Topology, Vec<TopologyIssue>> {
    Topology::parse(text, Path::new("conf/t.toml"))
}

fn valid(text: &str) -> Topology {
    match parse(text) {
        Ok(t) => t,
        Err(issues) => panic!("expected a valid topology, got {issues:#?}"),
    }
}

fn issues(text: &str) -> Vec<TopologyIssue> {
    match parse(text) {
        Ok(t) => panic!("expected errors, got a valid topology {t:#?}"),
        Err(issues) => issues,
    }
}

/// (line, class) of every error.
fn errors(text: &str) -> Vec<(usize, &'static str)> {
    issues(text)
        .iter()
        .filter(|i| i.is_error())
        .map(|i| (i.location.line, i.class()))
        .collect()
}

/// The 1-based line of the only occurrence of `needle` (the `nth` one, from 0).
fn line_of(text: &str, needle: &str, nth: usize) -> usize {
    let (offset, _) = text
        .match_indices(needle)
        .nth(nth)
        .unwrap_or_else(|| panic!("{needle:?} not in text"));
    text[..offset].matches('\n').count() + 1
}

/// `text` with the `nth` occurrence of `from` replaced by `to`.
fn replace_nth(text: &str, from: &str, nth: usize, to: &str) -> String {
    let (offset, _) = text
        .match_indices(from)
        .nth(nth)
        .unwrap_or_else(|| panic!("{from:?} not in text"));
    format!("{}{to}{}", &text[..offset], &text[offset + from.len()..])
}

/// BASE with the `nth` occurrence of `from` replaced by `to`.
fn edit(from: &str, nth: usize, to: &str) -> String {
    replace_nth(BASE, from, nth, to)
}

/// Asserts that BASE, edited as in [`edit`], fails with exactly one error, `class`, on one
/// of the lines of `to`.
fn assert_one(from: &str, nth: usize, to: &str, class: &str) -> TopologyIssue {
    let text = edit(from, nth, to);
    let all = issues(&text);
    let errs: Vec<_> = all.iter().filter(|i| i.is_error()).collect();
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert_eq!(errs[0].class(), class, "{errs:#?}");
    let (offset, _) = BASE.match_indices(from).nth(nth).unwrap_or((0, ""));
    let first = BASE[..offset].matches('\n').count() + 1;
    let lines = first..=first + to.matches('\n').count();
    assert!(
        lines.contains(&errs[0].location.line),
        "{lines:?}: {errs:#?}"
    );
    errs[0].clone()
}

#[test]
fn base_is_valid_with_defaults_and_resolved_paths() {
    let t = valid(BASE);
    assert!(t.warnings().is_empty(), "{:?}", t.warnings());
    assert_eq!(t.file(), Path::new("conf/t.toml"));
    let peer = &t.coordinators[0];
    assert_eq!(peer.id.0, 1);
    assert_eq!(peer.quic.to_string(), "10.0.0.1:7000");
    assert_eq!(peer.data_dir, PathBuf::from("conf/run/coordinator-1"));
    let model = t.model("m").expect("model m");
    assert_eq!(model.path, PathBuf::from("conf/models/m"));
    assert_eq!(model.format, ModelFormat::HfDirectory);
    assert_eq!(model.dtype, ModelDtype::Auto);
    assert_eq!(model.path_at.line, line_of(BASE, "path =", 0));
    let g = t.group("g").expect("group g");
    assert_eq!(g.tp, 2);
    assert_eq!(g.requested_collective, CollectiveChoice::Auto);
    assert_eq!(g.collective, Collective::Tcp, "cpu across hosts");
    assert_eq!(g.shards[1].host, "b");
    assert_eq!(g.shards[0].threads, 1);
    assert_eq!(g.shards[0].kv_memory_bytes, 1 << 30);
    assert_eq!(g.shards[0].device, Device::Cpu);
    assert_eq!(g.tp_at.line, line_of(BASE, "tp = 2", 0));
}

#[test]
fn auto_collective_is_shm_on_one_host_and_nccl_on_cuda() {
    let one_host = edit("host = \"b\"", 0, "host = \"a\"\nthreads = 3");
    let one_host = replace_nth(&one_host, "port = 7100", 1, "port = 7101");
    let t = valid(&one_host);
    let g = t.group("g").expect("group");
    assert_eq!(g.collective, Collective::Shm);
    assert_eq!(g.shards[1].threads, 3);
    let warnings: Vec<_> = t.warnings().iter().map(TopologyIssue::class).collect();
    assert_eq!(warnings, vec!["unused-host"]);
    assert_eq!(t.warnings()[0].location.line, line_of(BASE, "[[host]]", 1));

    let cuda = BASE.replace("device = \"cpu\"", "device = \"cuda:0\"");
    let t = valid(&cuda);
    assert_eq!(t.group("g").map(|g| g.collective), Some(Collective::Nccl));
    assert_eq!(
        t.group("g").map(|g| g.shards[0].device),
        Some(Device::Cuda(0))
    );
}

#[test]
fn syntax_errors_have_lines() {
    let text = BASE.replace("tp = 2", "tp = = 2");
    let errs = errors(&text);
    assert!(!errs.is_empty());
    assert!(
        errs.iter()
            .all(|(line, class)| *class == "syntax" && *line == 22),
        "{errs:?}"
    );
}

#[test]
fn unknown_keys_are_all_reported_with_lines() {
    let text = BASE
        .replace("id = 1\n", "id = 1\nquick = \"x\"\n")
        .replace("rank = 1\n", "rank = 1\ngpu = 2\nthread = 4\n")
        .replace("[[model]]", "[models]\nx = 1\n\n[[model]]");
    let all = issues(&text);
    let found: Vec<_> = all
        .iter()
        .map(|i| (i.location.line, i.class(), i.field.as_str()))
        .collect();
    assert_eq!(
        found,
        vec![
            (
                line_of(&text, "quick", 0),
                "unknown-key",
                "coordinator[0].quick"
            ),
            (line_of(&text, "[models]", 0), "unknown-key", "models"),
            (
                line_of(&text, "gpu = 2", 0),
                "unknown-key",
                "group[0].shard[1].gpu"
            ),
            (
                line_of(&text, "thread = 4", 0),
                "unknown-key",
                "group[0].shard[1].thread"
            ),
        ]
    );
    assert!(all[0].change().contains("quic"), "{}", all[0].change());
}

#[test]
fn wrong_types_are_reported_once_and_the_rest_is_still_checked() {
    let text = BASE
        .replace("tp = 2", "tp = \"two\"")
        .replace("port = 7100", "port = true")
        .replace("address = \"10.0.0.2\"", "address = \"10.0.0.2:1\"");
    let all = issues(&text);
    assert_eq!(
        all[1].message(),
        "group[0]: `tp` has an invalid value: invalid type: string \"two\", expected an integer"
    );
    let errs = errors(&text);
    assert_eq!(
        errs,
        vec![
            (line_of(&text, "10.0.0.2:1", 0), "bad-address"),
            (line_of(&text, "tp = \"two\"", 0), "invalid-value"),
            (line_of(&text, "port = true", 0), "invalid-value"),
            (line_of(&text, "port = true", 1), "invalid-value"),
        ]
    );
}

#[test]
fn serde_wording_is_translated() {
    let text = BASE
        .replace("id = 1", "id = 99999999999999999999")
        .replacen("host = \"a\"", "host = { x = 1 }", 1)
        .replacen("port = 7100", "port = [1]", 1);
    let messages: Vec<_> = issues(&text).iter().map(TopologyIssue::message).collect();
    assert_eq!(
        messages,
        vec![
            "coordinator[0]: `id` has an invalid value: the integer is too large",
            "coordinator[0]: `host` has an invalid value: invalid type: table, expected a string",
            "group[0].shard[0]: `port` has an invalid value: invalid type: array, expected an \
             integer",
        ]
    );
}

#[test]
fn tables_must_be_arrays_of_tables() {
    let text = BASE.replacen("[[host]]", "[host]", 1).replacen(
        "[[host]]\nname = \"b\"\naddress = \"10.0.0.2\"\n",
        "",
        1,
    );
    // Host a is known from the failed table; host b is gone.
    let errs = errors(&text);
    assert_eq!(
        errs,
        vec![
            (line_of(&text, "[host]", 0), "not-array-of-tables"),
            (line_of(&text, "host = \"b\"", 0), "unknown-host")
        ]
    );
}

#[test]
fn every_required_key_is_required() {
    for (key, nth) in [
        ("id = 1\n", 0),
        ("host = \"a\"\n", 0),
        ("quic = \"10.0.0.1:7000\"\n", 0),
        ("http = \"10.0.0.1:8000\"\n", 0),
        ("name = \"a\"\n", 0),
        ("address = \"10.0.0.1\"\n", 0),
        ("name = \"m\"\n", 0),
        ("path = \"models/m\"\n", 0),
        ("name = \"g\"\n", 0),
        ("model = \"m\"\n", 0),
        ("tp = 2\n", 0),
        ("rank = 1\n", 0),
        ("host = \"b\"\n", 0),
        ("device = \"cpu\"\n", 1),
        ("port = 7100\n", 1),
        ("kv_memory = \"1GiB\"\n", 1),
    ] {
        let text = edit(key, nth, "");
        let all = issues(&text);
        let missing: Vec<_> = all.iter().filter(|i| i.class() == "missing-key").collect();
        assert_eq!(missing.len(), 1, "{key}: {all:#?}");
        let expected = key.split(" =").next().unwrap_or(key);
        assert!(missing[0].field.ends_with(expected), "{key}: {missing:#?}");
        assert!(
            missing[0]
                .change()
                .starts_with(&format!("add {expected} = "))
        );
    }
}

#[test]
fn coordinator_count_must_be_odd_and_at_most_five() {
    let peer = "[[coordinator]]\nid = 2\nhost = \"b\"\nquic = \"10.0.0.2:7000\"\nhttp = \"10.0.0.2:8000\"\n";
    let two = format!("{BASE}\n{peer}");
    let errs = errors(&two);
    assert_eq!(
        errs,
        vec![(line_of(&two, "[[coordinator]]", 1), "coordinator-count")]
    );
    let three = format!(
        "{two}\n{}",
        peer.replace("id = 2", "id = 3")
            .replace("7000", "7001")
            .replace("8000", "8001")
    );
    valid(&three);
    let none = BASE.replacen(
        "[[coordinator]]\nid = 1\nhost = \"a\"\nquic = \"10.0.0.1:7000\"\nhttp = \"10.0.0.1:8000\"\n",
        "",
        1,
    );
    let all = issues(&none);
    assert_eq!(all[0].class(), "coordinator-count");
    assert_eq!(
        all[0].message(),
        "0 coordinator peers; raft needs 1, 3 or 5"
    );
    assert_eq!(all[0].location.line, 1);
}

#[test]
fn peer_ids_are_positive_and_unique() {
    assert_one("id = 1", 0, "id = 0", "peer-id-range");
    let peer = "[[coordinator]]\nid = 1\nhost = \"b\"\nquic = \"10.0.0.2:7000\"\nhttp = \"10.0.0.2:8000\"\n";
    let third = peer
        .replace("id = 1", "id = 3")
        .replace("10.0.0.2", "10.0.0.1")
        .replace("7000", "7001")
        .replace("8000", "8001");
    let text = format!("{BASE}\n{peer}\n{third}");
    let all = issues(&text);
    assert_eq!(all.len(), 1, "{all:#?}");
    assert_eq!(all[0].class(), "duplicate-peer-id");
    assert_eq!(all[0].location.line, line_of(&text, "id = 1", 1));
    assert!(
        all[0].message().contains("first at line 2"),
        "{}",
        all[0].message()
    );
}

#[test]
fn addresses_are_checked() {
    let e = assert_one("10.0.0.1:7000", 0, "10.0.0.1", "bad-address");
    assert!(e.change().contains("ip:port"), "{}", e.change());
    assert_one("10.0.0.1:8000", 0, "10.0.0.1:0", "bad-address");
    assert_one("10.0.0.1:8000", 0, "[::1:8000", "bad-address");
    assert_one("\"10.0.0.2\"", 0, "\"node b\"", "bad-address");
    assert_one("10.0.0.1:7000", 0, "0.0.0.0:7000", "wildcard-quic");
    // A wildcard HTTP address is fine: clients connect to the host's address.
    valid(&edit("10.0.0.1:8000", 0, "0.0.0.0:8000"));
}

#[test]
fn listeners_on_one_host_need_different_ports() {
    // Shard rank 0 on host a takes the coordinator's HTTP port.
    let e = assert_one("port = 7100", 0, "port = 8000", "port-collision");
    assert_eq!(
        e.message(),
        "host a: port 8000 is used by both coordinator 1 (http) and group g rank 0"
    );
    // quic and http of one peer.
    assert_one("10.0.0.1:8000", 0, "10.0.0.1:7000", "port-collision");
    // Two hosts with the same address are one machine.
    let text = edit("address = \"10.0.0.2\"", 0, "address = \"10.0.0.1\"");
    assert_eq!(
        errors(&text),
        vec![(line_of(&text, "port = 7100", 1), "port-collision")]
    );
    // Different bind addresses on one host do not collide; a wildcard collides with all.
    valid(&edit("10.0.0.1:8000", 0, "127.0.0.1:7100"));
    let text = edit("10.0.0.1:8000", 0, "0.0.0.0:7100");
    assert_eq!(
        errors(&text),
        vec![(line_of(&text, "port = 7100", 0), "port-collision")]
    );
    // Ports are checked per host: both shards use 7100 on different hosts in BASE.
    valid(BASE);
}

#[test]
fn coordinators_on_one_host_need_their_own_data_dir() {
    let peers = |dir2: &str| {
        format!(
            "{}\n[[coordinator]]\nid = 2\nhost = \"a\"\nquic = \"10.0.0.1:7001\"\nhttp = \"10.0.0.1:8001\"\n{dir2}\
             \n[[coordinator]]\nid = 3\nhost = \"b\"\nquic = \"10.0.0.2:7001\"\nhttp = \"10.0.0.2:8001\"\n",
            BASE.replace(
                "http = \"10.0.0.1:8000\"",
                "http = \"10.0.0.1:8000\"\ndata_dir = \"d\""
            )
        )
    };
    valid(&peers("data_dir = \"e\""));
    valid(&peers(""));
    let text = peers("data_dir = \"./../conf/d\"").replace("./../conf/d", "d");
    let errs = errors(&text);
    assert_eq!(
        errs,
        vec![(line_of(&text, "data_dir = \"d\"", 1), "shared-data-dir")]
    );
    let text = peers("data_dir = \"\"");
    assert_eq!(
        errors(&text),
        vec![(line_of(&text, "data_dir = \"\"", 0), "invalid-value")]
    );
}

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
