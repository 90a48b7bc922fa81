//! The raw contents of a topology file, as serde reads them. Every key is optional here and
//! keeps its byte span, so that validation (`Topology::from_spec`) can report a missing or
//! bad value with its line; text values such as sizes, devices and addresses stay text until
//! then. Unknown keys are refused (`deny_unknown_fields`).
//!
//! The key lists (`*_KEYS`) are the allowed keys of each table, for messages.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, Visitor};
use toml::Spanned;

/// Top-level keys of a topology file.
pub const TOPOLOGY_KEYS: &[&str] = &["coordinator", "host", "model", "group"];
/// Keys of a `[[coordinator]]` entry.
pub const COORDINATOR_KEYS: &[&str] = &["id", "host", "quic", "http", "data_dir"];
/// Keys of a `[[host]]` entry.
pub const HOST_KEYS: &[&str] = &["name", "address"];
/// Keys of a `[[model]]` entry.
pub const MODEL_KEYS: &[&str] = &["name", "path", "dtype"];
/// Keys of a `[[group]]` entry.
pub const GROUP_KEYS: &[&str] = &["name", "model", "tp", "collective", "precision", "shard"];
/// Keys of a `[[group.shard]]` entry.
pub const SHARD_KEYS: &[&str] = &["rank", "host", "device", "threads", "port", "kv_memory"];

/// A whole topology file.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopologySpec {
    #[serde(default)]
    pub coordinator: Vec<Spanned<CoordinatorSpec>>,
    #[serde(default)]
    pub host: Vec<Spanned<HostSpec>>,
    #[serde(default)]
    pub model: Vec<Spanned<ModelSpec>>,
    #[serde(default)]
    pub group: Vec<Spanned<GroupSpec>>,
}

/// `[[coordinator]]`: one raft peer.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CoordinatorSpec {
    pub id: Option<Spanned<i64>>,
    pub host: Option<Spanned<String>>,
    pub quic: Option<Spanned<String>>,
    pub http: Option<Spanned<String>>,
    pub data_dir: Option<Spanned<String>>,
}

/// `[[host]]`: one machine.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostSpec {
    pub name: Option<Spanned<String>>,
    pub address: Option<Spanned<String>>,
}

/// `[[model]]`: weights on disk.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub name: Option<Spanned<String>>,
    pub path: Option<Spanned<String>>,
    pub dtype: Option<Spanned<String>>,
}

/// `[[group]]`: one tensor-parallel group and its shards.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupSpec {
    pub name: Option<Spanned<String>>,
    pub model: Option<Spanned<String>>,
    pub tp: Option<Spanned<i64>>,
    pub collective: Option<Spanned<String>>,
    pub precision: Option<Spanned<String>>,
    #[serde(default)]
    pub shard: Vec<Spanned<ShardSpec>>,
}

/// `[[group.shard]]`: one rank of a group.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardSpec {
    pub rank: Option<Spanned<i64>>,
    pub host: Option<Spanned<String>>,
    pub device: Option<Spanned<String>>,
    pub threads: Option<Spanned<i64>>,
    pub port: Option<Spanned<i64>>,
    pub kv_memory: Option<Spanned<SizeSpec>>,
}

/// A size as written: `"512MiB"` or a bare number of bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SizeSpec {
    Bytes(i64),
    Text(String),
}

impl fmt::Display for SizeSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SizeSpec::Bytes(n) => write!(f, "{n}"),
            SizeSpec::Text(s) => write!(f, "{s:?}"),
        }
    }
}

impl<'de> Deserialize<'de> for SizeSpec {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SizeVisitor;
        impl Visitor<'_> for SizeVisitor {
            type Value = SizeSpec;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size such as \"2GiB\" or a number of bytes")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<SizeSpec, E> {
                Ok(SizeSpec::Bytes(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<SizeSpec, E> {
                i64::try_from(v)
                    .map(SizeSpec::Bytes)
                    .map_err(|_| E::custom(format!("{v} bytes is too large")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<SizeSpec, E> {
                Ok(SizeSpec::Text(v.to_owned()))
            }
        }
        deserializer.deserialize_any(SizeVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_serde_reads_a_whole_file_with_spans() {
        let text = "[[host]]\nname = \"a\"\naddress = \"10.0.0.1\"\n\n[[group]]\nname = \"g\"\n\
                    [[group.shard]]\nrank = 0\nkv_memory = \"1GiB\"\n[[group.shard]]\nrank = 1\n\
                    kv_memory = 1024\n";
        let spec: TopologySpec = toml::from_str(text).expect("valid spec");
        let host = spec.host[0].get_ref();
        let name = host.name.as_ref().expect("name");
        assert_eq!(name.get_ref(), "a");
        assert_eq!(&text[name.span()], "\"a\"");
        let shards = &spec.group[0].get_ref().shard;
        assert_eq!(shards.len(), 2);
        let kv: Vec<_> = shards
            .iter()
            .map(|s| s.get_ref().kv_memory.as_ref().map(|k| k.get_ref().clone()))
            .collect();
        assert_eq!(
            kv,
            vec![
                Some(SizeSpec::Text("1GiB".into())),
                Some(SizeSpec::Bytes(1024))
            ]
        );
    }

    #[test]
    fn unknown_keys_are_refused() {
        let err = toml::from_str::<TopologySpec>("[[host]]\nname = \"a\"\nadress = \"x\"\n")
            .expect_err("unknown key");
        assert!(err.message().contains("adress"), "{err}");
        let err = toml::from_str::<TopologySpec>("hosts = []\n").expect_err("unknown table");
        assert!(err.message().contains("hosts"), "{err}");
    }
}
