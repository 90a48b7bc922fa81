//! The log lines every Tessera process writes: `tracing` events on stderr, where
//! `tessera up` collects its children's lines into their log files. One setup, so that
//! the coordinator, the shards and the CLI format and filter alike.

use tracing_subscriber::EnvFilter;

/// Installs the process's subscriber: events on stderr, filtered by `directives` (the
/// binary's `TESSERA_LOG`, such as `info` or `tessera_shard=debug`), or by `default` when
/// there are none or they do not parse.
pub fn init(directives: Option<&str>, default: &str) {
    let filter = directives
        .and_then(|d| EnvFilter::try_new(d).ok())
        .unwrap_or_else(|| EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}
