//! [`TopologySpec`] → [`Topology`]: every rule that needs no model, each problem reported
//! with its place. Entries are checked one by one (hosts first, since coordinators and
//! shards refer to them), then the rules that span entries: listeners that collide on one
//! host, GPUs used twice, unused hosts and models. Groups live in `validate/groups.rs`.
//!
//! A validated part is only built when all its keys are good; the [`Topology`] only when no
//! error was found anywhere.

mod groups;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::ops::Range;
use std::path::PathBuf;

use toml::Spanned;

use crate::error::TopologyError;
use crate::issue::{Severity, Source, TopologyIssue, sort_issues};
use crate::parse::ParseNotes;
use crate::spec::{CoordinatorSpec, HostSpec, ModelSpec, TopologySpec};
use crate::topology::{
    CoordinatorPeer, Host, Model, ModelDtype, ModelFormat, NetAddr, PeerId, Topology,
};
use crate::units::{check_host_address, check_name, parse_net_addr};

/// Validates `spec`; `issues` are the parser's, merged into the result.
pub(crate) fn validate(
    spec: &TopologySpec,
    source: &Source<'_>,
    notes: &ParseNotes,
    issues: Vec<TopologyIssue>,
) -> Result<Topology, Vec<TopologyIssue>> {
    let mut v = Validator {
        source,
        notes,
        issues,
        listeners: Vec::new(),
        gpus: Vec::new(),
        used_hosts: HashSet::new(),
        used_models: HashSet::new(),
    };
    let hosts = v.hosts(&spec.host);
    let coordinators = v.coordinators(&spec.coordinator, &hosts);
    let models = v.models(&spec.model);
    let groups = v.groups(&spec.group, &hosts, &models);
    v.listener_collisions();
    v.shared_gpus();
    v.unused(spec, &hosts, &models);

    let mut issues = v.issues;
    sort_issues(&mut issues);
    if issues.iter().any(TopologyIssue::is_error) {
        return Err(issues);
    }
    Ok(Topology {
        coordinators,
        hosts: hosts.valid,
        models: models.valid,
        groups,
        file: source.path().to_path_buf(),
        warnings: issues,
    })
}

/// Hosts by name: the valid ones, and every name written (valid or not).
struct Hosts {
    valid: Vec<Host>,
    declared: HashSet<String>,
}

impl Hosts {
    fn get(&self, name: &str) -> Option<&Host> {
        self.valid.iter().find(|h| h.name == name)
    }
}

struct Models {
    valid: Vec<Model>,
    declared: HashSet<String>,
}

/// Where something binds: what two listeners on one host must not share.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Bind {
    /// `0.0.0.0` or `::`.
    Any,
    Ip(IpAddr),
    /// A DNS name: what it resolves to is unknown, so it may overlap anything.
    Name(String),
}

impl Bind {
    fn of(host: &str) -> Bind {
        match host.parse::<IpAddr>() {
            Ok(ip) if ip.is_unspecified() => Bind::Any,
            Ok(ip) => Bind::Ip(ip),
            Err(_) => Bind::Name(host.to_owned()),
        }
    }

    fn overlaps(&self, other: &Bind) -> bool {
        match (self, other) {
            (Bind::Ip(a), Bind::Ip(b)) => a == b,
            _ => true,
        }
    }
}

/// A port something listens on. Hosts with the same address are one machine.
struct Listener {
    machine: String,
    host: String,
    bind: Bind,
    port: u16,
    owner: String,
    span: Range<usize>,
    field: String,
}

/// A GPU a shard uses.
struct GpuUse {
    machine: String,
    host: String,
    index: u32,
    /// The shard's group moves collectives through host memory (`shm`, `tcp`).
    host_collective: bool,
    owner: String,
    span: Range<usize>,
    field: String,
}

struct Validator<'s> {
    source: &'s Source<'s>,
    notes: &'s ParseNotes,
    issues: Vec<TopologyIssue>,
    listeners: Vec<Listener>,
    gpus: Vec<GpuUse>,
    used_hosts: HashSet<String>,
    used_models: HashSet<String>,
}

impl Validator<'_> {
    fn error(&mut self, span: Range<usize>, field: impl Into<String>, error: TopologyError) {
        let issue = self.source.issue(Severity::Error, span, field, error);
        self.issues.push(issue);
    }

    fn warn(&mut self, span: Range<usize>, field: impl Into<String>, error: TopologyError) {
        let issue = self.source.issue(Severity::Warning, span, field, error);
        self.issues.push(issue);
    }

    fn line(&self, span: &Range<usize>) -> usize {
        self.source.locate(span.start).line
    }

    /// The value of a required key, or a `missing-key` error at the entry's header (unless
    /// the parser already reported and removed that key).
    fn required<'a, T>(
        &mut self,
        value: &'a Option<Spanned<T>>,
        entry: &Range<usize>,
        table: &str,
        key: &'static str,
    ) -> Option<&'a Spanned<T>> {
        if value.is_none() && !self.notes.is_broken(entry, key) {
            let error = TopologyError::MissingKey {
                table: table.to_owned(),
                key,
            };
            self.error(entry.clone(), format!("{table}.{key}"), error);
        }
        value.as_ref()
    }

    /// The `name` of an entry if present, valid and not used before by the same kind.
    fn unique_name(
        &mut self,
        value: Option<&Spanned<String>>,
        kind: &'static str,
        table: &str,
        seen: &mut HashMap<String, usize>,
    ) -> Option<String> {
        let value = value?;
        let name = value.get_ref();
        let field = format!("{table}.name");
        if let Err(reason) = check_name(name) {
            let error = TopologyError::BadName {
                what: table.to_owned(),
                key: "name",
                value: name.clone(),
                reason,
            };
            self.error(value.span(), field, error);
            return None;
        }
        if let Some(&first_line) = seen.get(name) {
            let error = TopologyError::DuplicateName {
                kind,
                name: name.clone(),
                first_line,
            };
            self.error(value.span(), field, error);
            return None;
        }
        seen.insert(name.clone(), self.line(&value.span()));
        Some(name.clone())
    }

    /// The host a coordinator or shard names, or an `unknown-host` error.
    fn host_ref<'h>(
        &mut self,
        value: &Spanned<String>,
        what: &str,
        field: String,
        hosts: &'h Hosts,
    ) -> Option<&'h Host> {
        let name = value.get_ref();
        self.used_hosts.insert(name.clone());
        if let Some(host) = hosts.get(name) {
            return Some(host);
        }
        if !hosts.declared.contains(name) && !self.notes.is_failed_name("host", name) {
            let error = TopologyError::UnknownHost {
                what: what.to_owned(),
                name: name.clone(),
                known: hosts.valid.iter().map(|h| h.name.clone()).collect(),
            };
            self.error(value.span(), field, error);
        }
        None
    }

    fn hosts(&mut self, specs: &[Spanned<HostSpec>]) -> Hosts {
        let mut hosts = Hosts {
            valid: Vec::new(),
            declared: HashSet::new(),
        };
        let mut seen = HashMap::new();
        for (i, entry) in specs.iter().enumerate() {
            let (span, spec) = (entry.span(), entry.get_ref());
            let table = format!("host[{i}]");
            if let Some(name) = &spec.name {
                hosts.declared.insert(name.get_ref().clone());
            }
            let name = self.required(&spec.name, &span, &table, "name");
            let name = self.unique_name(name, "host", &table, &mut seen);
            let what = name.as_ref().map_or(table.clone(), |n| format!("host {n}"));
            let address = match self.required(&spec.address, &span, &table, "address") {
                None => None,
                Some(a) => match check_host_address(a.get_ref()) {
                    Ok(()) => Some(a.get_ref().clone()),
                    Err(reason) => {
                        let error = TopologyError::BadAddress {
                            what,
                            key: "address",
                            value: a.get_ref().clone(),
                            reason,
                        };
                        self.error(a.span(), format!("{table}.address"), error);
                        None
                    }
                },
            };
            if let (Some(name), Some(address)) = (name, address) {
                hosts.valid.push(Host { name, address });
            }
        }
        hosts
    }

    fn coordinators(
        &mut self,
        specs: &[Spanned<CoordinatorSpec>],
        hosts: &Hosts,
    ) -> Vec<CoordinatorPeer> {
        let count = specs.len() + self.notes.failed("coordinator");
        if ![1, 3, 5].contains(&count) {
            let span = specs.last().map_or(0..0, Spanned::span);
            self.error(
                span,
                "coordinator",
                TopologyError::CoordinatorCount { count },
            );
        }
        let mut ids = HashMap::new();
        let mut data_dirs: HashMap<(String, PathBuf), u64> = HashMap::new();
        let mut peers = Vec::new();
        for (i, entry) in specs.iter().enumerate() {
            let Some((peer, machine)) = self.coordinator(i, entry, hosts, &mut ids) else {
                continue;
            };
            let key = (machine, peer.data_dir.clone());
            if let Some(&first) = data_dirs.get(&key) {
                let error = TopologyError::SharedDataDir {
                    host: peer.host.clone(),
                    dir: peer.data_dir.display().to_string(),
                    first,
                    second: peer.id.0,
                };
                let spec = entry.get_ref();
                let span = spec.data_dir.as_ref().map_or(entry.span(), Spanned::span);
                self.error(span, format!("coordinator[{i}].data_dir"), error);
                continue;
            }
            data_dirs.insert(key, peer.id.0);
            peers.push(peer);
        }
        peers
    }

    /// One peer, with the address of its host (its machine).
    fn coordinator(
        &mut self,
        i: usize,
        entry: &Spanned<CoordinatorSpec>,
        hosts: &Hosts,
        ids: &mut HashMap<u64, usize>,
    ) -> Option<(CoordinatorPeer, String)> {
        let (span, spec) = (entry.span(), entry.get_ref());
        let table = format!("coordinator[{i}]");
        let id = self
            .required(&spec.id, &span, &table, "id")
            .and_then(|id| self.peer_id(id, &table, ids));
        let what = id.map_or(table.clone(), |id| format!("coordinator {id}"));
        let host = self
            .required(&spec.host, &span, &table, "host")
            .and_then(|h| self.host_ref(h, &what, format!("{table}.host"), hosts));
        let quic = self.listen_addr(&spec.quic, &span, &table, &what, "quic");
        let http = self.listen_addr(&spec.http, &span, &table, &what, "http");
        let data_dir = self.data_dir(spec, &table, id);
        if let Some((addr, addr_span)) = &quic
            && addr.is_wildcard()
        {
            let error = TopologyError::WildcardQuic {
                what: what.clone(),
                value: addr.to_string(),
            };
            self.error(addr_span.clone(), format!("{table}.quic"), error);
        }
        if let Some(host) = host {
            for (addr, key) in [(&quic, "quic"), (&http, "http")] {
                let Some((addr, addr_span)) = addr else {
                    continue;
                };
                self.listeners.push(Listener {
                    machine: host.address.clone(),
                    host: host.name.clone(),
                    bind: Bind::of(&addr.host),
                    port: addr.port,
                    owner: format!("{what} ({key})"),
                    span: addr_span.clone(),
                    field: format!("{table}.{key}"),
                });
            }
        }
        let (Some(id), Some(host), Some(quic), Some(http), Some(data_dir)) =
            (id, host, quic, http, data_dir)
        else {
            return None;
        };
        if quic.0.is_wildcard() {
            return None;
        }
        let peer = CoordinatorPeer {
            id: PeerId(id),
            host: host.name.clone(),
            quic: quic.0,
            http: http.0,
            data_dir,
        };
        Some((peer, host.address.clone()))
    }

    /// A peer id: at least 1 and not used before.
    fn peer_id(
        &mut self,
        id: &Spanned<i64>,
        table: &str,
        ids: &mut HashMap<u64, usize>,
    ) -> Option<u64> {
        let field = format!("{table}.id");
        let Ok(value @ 1..) = u64::try_from(*id.get_ref()) else {
            let error = TopologyError::PeerIdRange { id: *id.get_ref() };
            self.error(id.span(), field, error);
            return None;
        };
        if let Some(&first_line) = ids.get(&value) {
            let error = TopologyError::DuplicatePeerId {
                id: value,
                first_line,
            };
            self.error(id.span(), field, error);
            return None;
        }
        ids.insert(value, self.line(&id.span()));
        Some(value)
    }

    /// A required `host:port` key of a coordinator, with its span.
    fn listen_addr(
        &mut self,
        value: &Option<Spanned<String>>,
        entry: &Range<usize>,
        table: &str,
        what: &str,
        key: &'static str,
    ) -> Option<(NetAddr, Range<usize>)> {
        let value = self.required(value, entry, table, key)?;
        match parse_net_addr(value.get_ref()) {
            Ok(addr) => Some((addr, value.span())),
            Err(reason) => {
                let error = TopologyError::BadAddress {
                    what: what.to_owned(),
                    key,
                    value: value.get_ref().clone(),
                    reason,
                };
                self.error(value.span(), format!("{table}.{key}"), error);
                None
            }
        }
    }

    /// `data_dir`, default `run/coordinator-<id>`, resolved against the file's directory.
    /// `None` after an error, or when the default is needed and the id is unknown.
    fn data_dir(
        &mut self,
        spec: &CoordinatorSpec,
        table: &str,
        id: Option<u64>,
    ) -> Option<PathBuf> {
        let Some(dir) = &spec.data_dir else {
            return id.map(|id| self.source.resolve(&format!("run/coordinator-{id}")));
        };
        if dir.get_ref().is_empty() {
            let error = TopologyError::InvalidValue {
                table: table.to_owned(),
                key: "data_dir".into(),
                message: "it is empty".into(),
            };
            self.error(dir.span(), format!("{table}.data_dir"), error);
            return None;
        }
        Some(self.source.resolve(dir.get_ref()))
    }

    fn models(&mut self, specs: &[Spanned<ModelSpec>]) -> Models {
        let mut models = Models {
            valid: Vec::new(),
            declared: HashSet::new(),
        };
        let mut seen = HashMap::new();
        for (i, entry) in specs.iter().enumerate() {
            let (span, spec) = (entry.span(), entry.get_ref());
            let table = format!("model[{i}]");
            if let Some(name) = &spec.name {
                models.declared.insert(name.get_ref().clone());
            }
            let name = self.required(&spec.name, &span, &table, "name");
            let name = self.unique_name(name, "model", &table, &mut seen);
            let label = name.clone().unwrap_or_else(|| table.clone());
            let path = self
                .required(&spec.path, &span, &table, "path")
                .and_then(|p| {
                    if p.get_ref().is_empty() {
                        let error = TopologyError::EmptyPath {
                            model: label.clone(),
                        };
                        self.error(p.span(), format!("{table}.path"), error);
                        return None;
                    }
                    Some(p)
                });
            let dtype = match &spec.dtype {
                None => Some(ModelDtype::Auto),
                Some(d) => self.dtype(d, &label, &table),
            };
            if let (Some(name), Some(path), Some(dtype)) = (name, path, dtype) {
                let format = if path.get_ref().to_ascii_lowercase().ends_with(".gguf") {
                    ModelFormat::Gguf
                } else {
                    ModelFormat::HfDirectory
                };
                models.valid.push(Model {
                    name,
                    path: self.source.resolve(path.get_ref()),
                    format,
                    dtype,
                    path_at: self.source.locate(path.span().start),
                    index: i,
                });
            }
        }
        models
    }

    fn dtype(&mut self, value: &Spanned<String>, model: &str, table: &str) -> Option<ModelDtype> {
        match value.get_ref().as_str() {
            "auto" => Some(ModelDtype::Auto),
            "f32" => Some(ModelDtype::F32),
            "bf16" => Some(ModelDtype::Bf16),
            "f16" => Some(ModelDtype::F16),
            other => {
                let error = TopologyError::BadDtype {
                    model: model.to_owned(),
                    value: other.to_owned(),
                };
                self.error(value.span(), format!("{table}.dtype"), error);
                None
            }
        }
    }

    /// Two listeners on one machine with one port and overlapping bind addresses.
    fn listener_collisions(&mut self) {
        let mut listeners = std::mem::take(&mut self.listeners);
        listeners.sort_by_key(|l| l.span.start);
        for (i, later) in listeners.iter().enumerate() {
            let clash = listeners[..i].iter().find(|earlier| {
                earlier.machine == later.machine
                    && earlier.port == later.port
                    && earlier.bind.overlaps(&later.bind)
            });
            if let Some(earlier) = clash {
                let error = TopologyError::PortCollision {
                    host: later.host.clone(),
                    port: later.port,
                    first: earlier.owner.clone(),
                    second: later.owner.clone(),
                };
                self.error(later.span.clone(), later.field.clone(), error);
            }
        }
    }

    /// Two shards on one GPU, unless both move their collectives through host memory
    /// (then they may share it: tp > 1 on one GPU, for tests).
    fn shared_gpus(&mut self) {
        let mut gpus = std::mem::take(&mut self.gpus);
        gpus.sort_by_key(|g| g.span.start);
        for (i, later) in gpus.iter().enumerate() {
            let clash = gpus[..i].iter().find(|e| {
                e.machine == later.machine
                    && e.index == later.index
                    && !(e.host_collective && later.host_collective)
            });
            if let Some(earlier) = clash {
                let error = TopologyError::SharedCudaDevice {
                    host: later.host.clone(),
                    device: format!("cuda:{}", later.index),
                    first: earlier.owner.clone(),
                    second: later.owner.clone(),
                };
                self.error(later.span.clone(), later.field.clone(), error);
            }
        }
    }

    /// Warnings: hosts and models nothing uses, and a cluster without groups. Skipped when
    /// the parser dropped entries or keys, since those may have been the users.
    fn unused(&mut self, spec: &TopologySpec, hosts: &Hosts, models: &Models) {
        if self.notes.dropped_anything() {
            return;
        }
        for (i, entry) in spec.host.iter().enumerate() {
            if let Some(name) = &entry.get_ref().name
                && hosts.get(name.get_ref()).is_some()
                && !self.used_hosts.contains(name.get_ref())
            {
                let error = TopologyError::UnusedHost {
                    name: name.get_ref().clone(),
                };
                self.warn(entry.span(), format!("host[{i}]"), error);
            }
        }
        let used: BTreeSet<&String> = self.used_models.iter().collect();
        let unused: Vec<(usize, String)> = models
            .valid
            .iter()
            .filter(|m| !used.contains(&m.name))
            .map(|m| (m.index, m.name.clone()))
            .collect();
        for (index, name) in unused {
            let span = spec.model[index].span();
            self.warn(
                span,
                format!("model[{index}]"),
                TopologyError::UnusedModel { name },
            );
        }
        if spec.group.is_empty() {
            self.warn(0..0, "group", TopologyError::NoGroups);
        }
    }
}

#[cfg(test)]
mod tests;
