//! The Hugging Face shard index (`model.safetensors.index.json`): which shard
//! holds each tensor, and the total tensor bytes.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::format::Header;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardIndex {
    /// `metadata.total_size`, when present.
    pub total_size: Option<u64>,
    /// Tensor name -> shard file name.
    pub weight_map: BTreeMap<String, String>,
}

/// Why an index file was refused: which field is wrong.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error("not valid JSON: {0}")]
    NotJson(#[source] serde_json::Error),
    #[error("{0}")]
    Field(String),
}

impl crate::errno::ToErrno for IndexError {
    fn to_errno(&self) -> i32 {
        libc::EINVAL
    }
}

/// Parses an index file.
pub fn parse_index(bytes: &[u8]) -> Result<ShardIndex, IndexError> {
    let field = |why: &str| IndexError::Field(why.to_string());
    let value: Value = serde_json::from_slice(bytes).map_err(IndexError::NotJson)?;
    let obj = value
        .as_object()
        .ok_or_else(|| field("not a JSON object"))?;
    let map = obj
        .get("weight_map")
        .ok_or_else(|| field("has no \"weight_map\""))?
        .as_object()
        .ok_or_else(|| field("\"weight_map\" is not an object"))?;
    let mut weight_map = BTreeMap::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| {
            field(&format!(
                "\"weight_map\" entry {name:?} is not a file name string"
            ))
        })?;
        weight_map.insert(name.clone(), file.to_string());
    }
    let total_size = match obj.get("metadata").and_then(|m| m.get("total_size")) {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            total_size_of(v).ok_or_else(|| field("\"metadata.total_size\" is not a byte count"))?,
        ),
    };
    Ok(ShardIndex {
        total_size,
        weight_map,
    })
}

/// Writers store total_size as an integer, some as an integral float.
fn total_size_of(v: &Value) -> Option<u64> {
    if let Some(n) = v.as_u64() {
        return Some(n);
    }
    let f = v.as_f64()?;
    (f >= 0.0 && f.fract() == 0.0 && f < u64::MAX as f64).then_some(f as u64)
}

/// Checks an index against the shards it describes (shard file name -> header).
/// Returns one line per problem; empty when they agree.
pub fn check_index(index: &ShardIndex, shards: &BTreeMap<String, &Header>) -> Vec<String> {
    let mut problems = Vec::new();
    for (tensor, file) in &index.weight_map {
        match shards.get(file) {
            None => problems.push(format!(
                "weight_map puts tensor {tensor:?} in {file:?}, which is not a shard here"
            )),
            Some(h) if h.get(tensor).is_none() => problems.push(format!(
                "weight_map puts tensor {tensor:?} in {file:?}, which does not hold it"
            )),
            Some(_) => {}
        }
    }
    let mut total: u128 = 0;
    for (file, header) in shards {
        for t in &header.tensors {
            total += t.nbytes() as u128;
            match index.weight_map.get(t.name) {
                None => problems.push(format!(
                    "tensor {:?} of {file:?} is missing from weight_map",
                    t.name
                )),
                Some(listed) if listed != file => problems.push(format!(
                    "tensor {:?} is in {file:?} but weight_map says {listed:?}",
                    t.name
                )),
                Some(_) => {}
            }
        }
    }
    if let Some(expected) = index.total_size {
        if expected as u128 != total {
            problems.push(format!(
                "metadata.total_size is {expected} but the shards hold {total} tensor bytes"
            ));
        }
    }
    problems
}
