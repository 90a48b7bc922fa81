//! TOML text → [`TopologySpec`], collecting every syntax and schema problem instead of
//! stopping at the first.
//!
//! serde stops at the first error of a document, so the parser first reads the document
//! into toml's spanned tree, then deserializes each `[[coordinator]]`, `[[host]]`,
//! `[[model]]`, `[[group]]` and `[[group.shard]]` entry on its own. When an entry fails on
//! one key (unknown key, value of the wrong type), that key is reported, removed, and the
//! entry is read again, so one entry reports all its bad keys and still reaches validation.
//! [`ParseNotes`] remembers what was dropped, so validation does not report it twice (a
//! removed key as missing, a reference to a dropped entry as unknown).
//!
//! Syntax errors end the work at this stage: the tree recovered around them is unreliable.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use serde::de::DeserializeOwned;
use toml::Spanned;
use toml::de::{DeTable, DeValue, ValueDeserializer};

use crate::error::TopologyError;
use crate::issue::{Severity, Source, TopologyIssue};
use crate::spec::{
    COORDINATOR_KEYS, GROUP_KEYS, HOST_KEYS, MODEL_KEYS, SHARD_KEYS, TOPOLOGY_KEYS, TopologySpec,
};

/// What the parser dropped, for validation.
#[derive(Debug, Default)]
pub(crate) struct ParseNotes {
    /// (start of the entry's span, key) of every key reported and removed.
    broken_keys: HashSet<(usize, String)>,
    /// Entries that could not be read at all, by top-level key.
    failed_entries: HashMap<&'static str, usize>,
    /// (top-level key, name) of entries that could not be read, so that references to
    /// them are not reported as unknown.
    failed_names: HashSet<(&'static str, String)>,
    /// Start of the span of groups with a shard entry that could not be read.
    incomplete_groups: HashSet<usize>,
}

impl ParseNotes {
    /// The key was reported by the parser; do not report it again.
    pub(crate) fn is_broken(&self, entry: &Range<usize>, key: &str) -> bool {
        self.broken_keys.contains(&(entry.start, key.to_owned()))
    }

    /// How many `[[kind]]` entries could not be read.
    pub(crate) fn failed(&self, kind: &str) -> usize {
        self.failed_entries.get(kind).copied().unwrap_or(0)
    }

    /// An entry of this kind and name could not be read.
    pub(crate) fn is_failed_name(&self, kind: &'static str, name: &str) -> bool {
        self.failed_names.contains(&(kind, name.to_owned()))
    }

    pub(crate) fn is_incomplete_group(&self, group: &Range<usize>) -> bool {
        self.incomplete_groups.contains(&group.start)
    }

    /// Something was dropped: conclusions about what is unused would be guesses.
    pub(crate) fn dropped_anything(&self) -> bool {
        !self.broken_keys.is_empty() || !self.failed_entries.is_empty()
    }
}

/// The spec, what was dropped, and the problems found so far.
#[derive(Debug)]
pub(crate) struct Parsed {
    pub(crate) spec: TopologySpec,
    pub(crate) notes: ParseNotes,
    pub(crate) issues: Vec<TopologyIssue>,
}

/// Reads the file. Syntax errors are returned alone; schema problems travel in `Parsed`.
pub(crate) fn parse(source: &Source<'_>) -> Result<Parsed, Vec<TopologyIssue>> {
    let (document, syntax_errors) = DeTable::parse_recoverable(source.text());
    if !syntax_errors.is_empty() {
        return Err(syntax_errors
            .iter()
            .map(|e| {
                let span = e.span().unwrap_or(0..0);
                let message = e.message().trim().to_owned();
                source.issue(Severity::Error, span, "", TopologyError::Syntax { message })
            })
            .collect());
    }
    let mut parser = Parser {
        source,
        notes: ParseNotes::default(),
        issues: Vec::new(),
    };
    let spec = parser.document(document.into_inner());
    Ok(Parsed {
        spec,
        notes: parser.notes,
        issues: parser.issues,
    })
}

struct Parser<'s> {
    source: &'s Source<'s>,
    notes: ParseNotes,
    issues: Vec<TopologyIssue>,
}

impl Parser<'_> {
    fn document(&mut self, document: DeTable<'_>) -> TopologySpec {
        let mut spec = TopologySpec::default();
        for (key, value) in document {
            match key.get_ref().as_ref() {
                "coordinator" => {
                    spec.coordinator = self.entries("coordinator", value, COORDINATOR_KEYS)
                }
                "host" => spec.host = self.entries("host", value, HOST_KEYS),
                "model" => spec.model = self.entries("model", value, MODEL_KEYS),
                "group" => spec.group = self.groups(value),
                other => self.unknown_key(key.span(), "the file", "", other, TOPOLOGY_KEYS),
            }
        }
        spec
    }

    /// The elements of a top-level array of tables, each read on its own.
    fn entries<T: DeserializeOwned>(
        &mut self,
        kind: &'static str,
        value: Spanned<DeValue<'_>>,
        allowed: &'static [&'static str],
    ) -> Vec<Spanned<T>> {
        let Some(elements) = self.array_of_tables(kind, kind, value) else {
            *self.notes.failed_entries.entry(kind).or_default() += 1;
            return Vec::new();
        };
        let mut out = Vec::new();
        for (i, element) in elements.into_iter().enumerate() {
            match self.entry(kind, &format!("{kind}[{i}]"), element, allowed) {
                Some(entry) => out.push(entry),
                None => *self.notes.failed_entries.entry(kind).or_default() += 1,
            }
        }
        out
    }

    /// `[[group]]` entries: the `shard` array is taken out and read entry by entry.
    fn groups(&mut self, value: Spanned<DeValue<'_>>) -> Vec<Spanned<crate::spec::GroupSpec>> {
        let Some(elements) = self.array_of_tables("group", "group", value) else {
            *self.notes.failed_entries.entry("group").or_default() += 1;
            return Vec::new();
        };
        let mut out = Vec::new();
        for (i, mut element) in elements.into_iter().enumerate() {
            let table = format!("group[{i}]");
            let group_span = element.span();
            let shards = match element.get_mut() {
                DeValue::Table(t) => t.remove("shard"),
                _ => None,
            };
            let mut shard_specs = Vec::new();
            if let Some(shards) = shards {
                let path = format!("{table}.shard");
                match self.array_of_tables("group.shard", &path, shards) {
                    Some(elements) => {
                        for (j, shard) in elements.into_iter().enumerate() {
                            let label = format!("{table}.shard[{j}]");
                            match self.entry("group.shard", &label, shard, SHARD_KEYS) {
                                Some(s) => shard_specs.push(s),
                                None => {
                                    self.notes.incomplete_groups.insert(group_span.start);
                                }
                            }
                        }
                    }
                    None => {
                        self.notes.incomplete_groups.insert(group_span.start);
                    }
                }
            }
            match self.entry::<crate::spec::GroupSpec>("group", &table, element, GROUP_KEYS) {
                Some(mut group) => {
                    group.get_mut().shard = shard_specs;
                    out.push(group);
                }
                None => *self.notes.failed_entries.entry("group").or_default() += 1,
            }
        }
        out
    }

    /// The elements of `value` if it is an array of tables; reports it otherwise.
    fn array_of_tables<'i>(
        &mut self,
        kind: &'static str,
        path: &str,
        value: Spanned<DeValue<'i>>,
    ) -> Option<Vec<Spanned<DeValue<'i>>>> {
        let span = value.span();
        match value.into_inner() {
            DeValue::Array(array) => {
                let elements: Vec<_> = array.into_iter().collect();
                if elements.iter().all(|e| e.get_ref().is_table()) {
                    return Some(elements);
                }
                for element in &elements {
                    if let DeValue::Table(table) = element.get_ref() {
                        self.record_failed_name(kind, table);
                    }
                }
            }
            DeValue::Table(table) => self.record_failed_name(kind, &table),
            _ => {}
        }
        let error = TopologyError::NotArrayOfTables {
            key: kind.to_owned(),
        };
        self.issues
            .push(self.source.issue(Severity::Error, span, path, error));
        None
    }

    /// Deserializes one entry; on a key-level failure, reports the key, removes it and
    /// tries again. `None` when the entry cannot be read at all.
    fn entry<T: DeserializeOwned>(
        &mut self,
        kind: &'static str,
        label: &str,
        mut value: Spanned<DeValue<'_>>,
        allowed: &'static [&'static str],
    ) -> Option<Spanned<T>> {
        let entry_span = value.span();
        loop {
            let error =
                match serde::Deserialize::deserialize(ValueDeserializer::from(value.clone())) {
                    Ok(entry) => return Some(entry),
                    Err(error) => error,
                };
            let DeValue::Table(table) = value.get_mut() else {
                unreadable_entry(self, label, entry_span, &error);
                return None;
            };
            let Some((key, on_key, key_span)) = error.span().and_then(|s| key_at(table, &s)) else {
                self.record_failed_name(kind, table);
                unreadable_entry(self, label, entry_span, &error);
                return None;
            };
            if on_key {
                self.unknown_key(key_span, label, label, &key, allowed);
            } else {
                let error = TopologyError::InvalidValue {
                    table: label.to_owned(),
                    key: key.clone(),
                    message: plain(error.message()),
                };
                let field = format!("{label}.{key}");
                self.issues
                    .push(self.source.issue(Severity::Error, key_span, field, error));
            }
            table.remove(key.as_str());
            self.notes.broken_keys.insert((entry_span.start, key));
        }
    }

    fn record_failed_name(&mut self, kind: &'static str, table: &DeTable<'_>) {
        if let Some(DeValue::String(name)) = table.get("name").map(|v| v.get_ref()) {
            self.notes.failed_names.insert((kind, name.to_string()));
        }
    }

    fn unknown_key(
        &mut self,
        span: Range<usize>,
        table: &str,
        path: &str,
        key: &str,
        allowed: &'static [&'static str],
    ) {
        let error = TopologyError::UnknownKey {
            table: table.to_owned(),
            key: key.to_owned(),
            allowed,
        };
        let field = if path.is_empty() {
            key.to_owned()
        } else {
            format!("{path}.{key}")
        };
        self.issues
            .push(self.source.issue(Severity::Error, span, field, error));
    }
}

/// An entry failed in a way no single key explains.
fn unreadable_entry(
    parser: &mut Parser<'_>,
    label: &str,
    span: Range<usize>,
    error: &toml::de::Error,
) {
    let error = TopologyError::InvalidEntry {
        table: label.to_owned(),
        message: plain(error.message()),
    };
    parser
        .issues
        .push(parser.source.issue(Severity::Error, span, label, error));
}

/// serde's wording in TOML's words: tables and arrays, integers rather than i64.
fn plain(message: &str) -> String {
    if message.contains(" as i128") || message.contains(" as u128") {
        return "the integer is too large".into();
    }
    message
        .replace("invalid type: map", "invalid type: table")
        .replace("invalid type: sequence", "invalid type: array")
        .replace("floating point", "float")
        .replace("expected i64", "expected an integer")
}

/// The key of `table` whose name (`true`) or value (`false`) contains `span`, with the span
/// of that name or value.
fn key_at(table: &DeTable<'_>, span: &Range<usize>) -> Option<(String, bool, Range<usize>)> {
    let within = |outer: &Range<usize>| outer.start <= span.start && span.end <= outer.end;
    table.iter().find_map(|(k, v)| {
        let key = k.get_ref().to_string();
        if within(&k.span()) {
            Some((key, true, k.span()))
        } else if within(&v.span()) {
            Some((key, false, v.span()))
        } else {
            None
        }
    })
}
