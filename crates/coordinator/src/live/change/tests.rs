use std::path::Path;

use super::*;

/// A topology of one peer, host `local` and these groups (`name`, `model`, first port);
/// model `m` lives at `/models/m`, unless `paths` says otherwise.
fn topology(groups: &[(&str, &str, u16)], paths: &[(&str, &str)], http: &str) -> Topology {
    let mut text = format!(
        "[[coordinator]]\nid = 1\nhost = \"local\"\nquic = \"127.0.0.1:7000\"\nhttp = \"{http}\"\n\
         data_dir = \"c1\"\n\n[[host]]\nname = \"local\"\naddress = \"127.0.0.1\"\n\n"
    );
    let mut models: Vec<&str> = groups.iter().map(|g| g.1).collect();
    models.dedup();
    for model in models {
        let path = (paths.iter().find(|p| p.0 == model))
            .map_or(format!("/models/{model}"), |p| p.1.to_string());
        text += &format!("[[model]]\nname = \"{model}\"\npath = \"{path}\"\n\n");
    }
    for (name, model, port) in groups {
        text += &format!("[[group]]\nname = \"{name}\"\nmodel = \"{model}\"\ntp = 2\n\n");
        for rank in 0..2 {
            text += &format!(
                "[[group.shard]]\nrank = {rank}\nhost = \"local\"\ndevice = \"cpu\"\nport = {}\nkv_memory = \"16MiB\"\n\n",
                port + rank
            );
        }
    }
    Topology::parse(&text, Path::new("/t/topology.toml")).expect("a valid test topology")
}

const HTTP: &str = "127.0.0.1:8000";

#[test]
fn groups_and_models_are_added_and_removed_by_name() {
    let current = topology(&[("a", "m", 9000), ("b", "m", 9010)], &[], HTTP);
    let next = topology(&[("a", "m", 9000), ("c", "n", 9020)], &[], HTTP);
    let change = TopologyChange::between(&current, &next, &[]).unwrap();
    assert_eq!(change.added_groups, ["c"]);
    assert_eq!(change.removed_groups, ["b"]);
    assert_eq!(change.added_models, ["n"]);
    assert!(change.removed_models.is_empty());
    assert!(!change.is_empty());
    let back = TopologyChange::between(&next, &current, &[]).unwrap();
    assert_eq!(
        (back.added_groups, back.removed_models),
        (vec!["b".to_string()], vec!["n".to_string()])
    );
    assert!(
        TopologyChange::between(&current, &current, &[])
            .unwrap()
            .is_empty()
    );
    let records = model_records(&next);
    assert_eq!(records["m"].groups, ["a"]);
    assert_eq!(
        (records["n"].path.as_str(), &records["n"].groups[..]),
        ("/models/n", &["c".to_string()][..])
    );
}

#[test]
fn what_stays_may_not_change_and_each_refusal_says_what_to_do() {
    let current = topology(&[("a", "m", 9000)], &[], HTTP);
    let moved = topology(&[("a", "m", 9100)], &[], HTTP);
    let error = TopologyChange::between(&current, &moved, &[]).unwrap_err();
    assert!(
        error.contains("group `a`") && error.contains("another name"),
        "{error}"
    );

    let new_files = topology(&[("a", "m", 9000)], &[("m", "/models/m-2")], HTTP);
    let error = TopologyChange::between(&current, &new_files, &[]).unwrap_err();
    assert!(error.contains("tessera model deploy"), "{error}");

    let other_peer = topology(&[("a", "m", 9000)], &[], "127.0.0.1:8001");
    let error = TopologyChange::between(&current, &other_peer, &[]).unwrap_err();
    assert!(error.contains("tessera cluster add|remove"), "{error}");
}

#[test]
fn a_model_with_a_canary_running_keeps_its_groups() {
    let current = topology(&[("a", "m", 9000)], &[], HTTP);
    let more = topology(
        &[("a", "m", 9000), ("b", "m", 9010), ("c", "n", 9020)],
        &[],
        HTTP,
    );
    let error = TopologyChange::between(&current, &more, &["m".into()]).unwrap_err();
    assert!(error.contains("model `m` has a canary running"), "{error}");
    let other = topology(&[("a", "m", 9000), ("c", "n", 9020)], &[], HTTP);
    assert!(
        TopologyChange::between(&current, &other, &["m".into()]).is_ok(),
        "model n has none"
    );
}
