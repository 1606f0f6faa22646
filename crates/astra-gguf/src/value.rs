//! Metadata values: the thirteen GGUF value types, typed arrays, and the key-value
//! table with accessors whose errors name the key and the type that was expected.

use crate::error::MetadataError;

/// The type tag of a metadata value, as stored in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// Bytes the smallest encoded value of this type takes: what a count read from the
    /// file is checked against before anything is allocated for it.
    pub fn min_encoded_len(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 => 8,
            String => 8,    // u64 length
            Array => 4 + 8, // element type + u64 count
        }
    }

    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A homogeneous array, stored by element type (a vocabulary of 262144 strings is one
/// `Vec<String>`, not 262144 tagged values). Arrays of arrays nest.
#[derive(Debug, Clone, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<Array>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// The value as an unsigned integer, when it is an integer of any width that is
    /// not negative (GGUF writers disagree on widths: u32 and i32 both appear for
    /// counts).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, when it is a float or an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// A short human-readable rendering; long arrays are summarised.
    pub fn summary(&self) -> String {
        match self {
            Value::String(s) if s.chars().count() > 60 => {
                format!(
                    "{:?}… ({} bytes)",
                    s.chars().take(60).collect::<String>(),
                    s.len()
                )
            }
            Value::String(s) => format!("{s:?}"),
            Value::Array(a) => format!("[{} × {}]", a.len(), a.element_type().name()),
            Value::Bool(b) => b.to_string(),
            Value::F32(v) => v.to_string(),
            Value::F64(v) => v.to_string(),
            other => other
                .as_u64()
                .map(|v| v.to_string())
                .unwrap_or_else(|| other.as_f64().map(|v| v.to_string()).unwrap_or_default()),
        }
    }
}

impl Array {
    pub fn element_type(&self) -> ValueType {
        match self {
            Array::U8(_) => ValueType::U8,
            Array::I8(_) => ValueType::I8,
            Array::U16(_) => ValueType::U16,
            Array::I16(_) => ValueType::I16,
            Array::U32(_) => ValueType::U32,
            Array::I32(_) => ValueType::I32,
            Array::F32(_) => ValueType::F32,
            Array::Bool(_) => ValueType::Bool,
            Array::String(_) => ValueType::String,
            Array::Array(_) => ValueType::Array,
            Array::U64(_) => ValueType::U64,
            Array::I64(_) => ValueType::I64,
            Array::F64(_) => ValueType::F64,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The key-value metadata of a GGUF file, in file order, keys unique.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metadata {
    entries: Vec<(String, Value)>,
}

impl Metadata {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key`, replacing an earlier value of the same key.
    pub fn set(&mut self, key: impl Into<String>, value: Value) {
        let key = key.into();
        match self.entries.iter_mut().find(|(k, _)| *k == key) {
            Some(entry) => entry.1 = value,
            None => self.entries.push((key, value)),
        }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn contains(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn require(&self, key: &str) -> Result<&Value, MetadataError> {
        self.get(key).ok_or_else(|| MetadataError::Missing {
            key: key.to_owned(),
        })
    }

    fn wrong(key: &str, expected: &'static str, found: &Value) -> MetadataError {
        MetadataError::WrongType {
            key: key.to_owned(),
            expected,
            found: found.value_type().name(),
        }
    }

    /// A string value.
    pub fn str(&self, key: &str) -> Result<&str, MetadataError> {
        match self.require(key)? {
            Value::String(s) => Ok(s),
            other => Err(Self::wrong(key, "string", other)),
        }
    }

    /// A non-negative integer of any width.
    pub fn u64(&self, key: &str) -> Result<u64, MetadataError> {
        let v = self.require(key)?;
        v.as_u64()
            .ok_or_else(|| Self::wrong(key, "unsigned integer", v))
    }

    /// A non-negative integer that fits in u32.
    pub fn u32(&self, key: &str) -> Result<u32, MetadataError> {
        let v = self.require(key)?;
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| Self::wrong(key, "unsigned 32-bit integer", v))
    }

    /// A float (f32 or f64; integers are accepted too).
    pub fn f32(&self, key: &str) -> Result<f32, MetadataError> {
        let v = self.require(key)?;
        v.as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| Self::wrong(key, "float", v))
    }

    pub fn bool(&self, key: &str) -> Result<bool, MetadataError> {
        match self.require(key)? {
            Value::Bool(b) => Ok(*b),
            other => Err(Self::wrong(key, "bool", other)),
        }
    }

    pub fn array(&self, key: &str) -> Result<&Array, MetadataError> {
        match self.require(key)? {
            Value::Array(a) => Ok(a),
            other => Err(Self::wrong(key, "array", other)),
        }
    }

    /// An array of strings.
    pub fn strings(&self, key: &str) -> Result<&[String], MetadataError> {
        match self.array(key)? {
            Array::String(v) => Ok(v),
            other => Err(MetadataError::WrongType {
                key: key.to_owned(),
                expected: "array of string",
                found: other.element_type().name(),
            }),
        }
    }

    /// The value of `key` if present, through `get`; a present value of the wrong type
    /// is still an error.
    pub fn optional<'a, T>(
        &'a self,
        key: &str,
        get: impl FnOnce(&'a Self, &str) -> Result<T, MetadataError>,
    ) -> Result<Option<T>, MetadataError> {
        if self.contains(key) {
            get(self, key).map(Some)
        } else {
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accessors_name_the_key_and_expected_type() {
        let mut m = Metadata::new();
        m.set("a.count", Value::I32(7));
        m.set("a.name", Value::String("x".into()));
        m.set("a.neg", Value::I32(-1));
        assert_eq!(m.u32("a.count").unwrap(), 7);
        assert_eq!(m.f32("a.count").unwrap(), 7.0);
        let err = m.u32("a.name").unwrap_err().to_string();
        assert!(
            err.contains("a.name") && err.contains("unsigned") && err.contains("string"),
            "{err}"
        );
        let err = m.u64("a.neg").unwrap_err().to_string();
        assert!(err.contains("a.neg"), "{err}");
        let err = m.str("missing.key").unwrap_err().to_string();
        assert!(err.contains("missing.key"), "{err}");
        assert_eq!(m.optional("missing.key", Metadata::u32).unwrap(), None);
        assert!(m.optional("a.name", Metadata::u32).is_err());
    }
}
