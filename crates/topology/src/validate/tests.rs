//! One test per rule: a valid file, changed in one place, must give that rule's error at the
//! line of the change.

use std::path::{Path, PathBuf};

use crate::error::TopologyError;
use crate::issue::{Severity, TopologyIssue};
use crate::plan::ModelShape;
use crate::topology::{
    Collective, CollectiveChoice, Device, ModelDtype, ModelFormat, Precision, Topology,
};

/// The rules on hosts, names, models, groups and shards.
mod groups;

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
    assert_eq!(g.precision, Precision::Exact, "the default");
    let fast = valid(&edit("tp = 2", 0, "tp = 2\nprecision = \"fast\""));
    assert_eq!(fast.group("g").map(|g| g.precision), Some(Precision::Fast));
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
