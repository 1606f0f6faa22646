//! GGUF reader and writer against each other (round trips) and against corruption of
//! the real model files at every structural boundary.

use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::cell::Cell;
use std::time::{Duration, Instant};

use astra_gguf::{Array, GgmlType, Gguf, GgufWriter, ParseErrorKind, TensorSource, Value};
use proptest::prelude::*;

/// Records the largest single allocation made by the current thread, so a test can
/// show that a corrupt count never turns into a large allocation.
struct TrackingAlloc;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for TrackingAlloc {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        let _ = LARGEST.try_with(|l| l.set(l.get().max(layout.size())));
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: AllocLayout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: AllocLayout, new_size: usize) -> *mut u8 {
        let _ = LARGEST.try_with(|l| l.set(l.get().max(new_size)));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: TrackingAlloc = TrackingAlloc;

// ---------------------------------------------------------------- round trips

fn scalar_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<u8>().prop_map(Value::U8),
        any::<i8>().prop_map(Value::I8),
        any::<u16>().prop_map(Value::U16),
        any::<i16>().prop_map(Value::I16),
        any::<u32>().prop_map(Value::U32),
        any::<i32>().prop_map(Value::I32),
        any::<f32>()
            .prop_filter("NaN != NaN", |x| !x.is_nan())
            .prop_map(Value::F32),
        any::<bool>().prop_map(Value::Bool),
        ".{0,40}".prop_map(Value::String),
        any::<u64>().prop_map(Value::U64),
        any::<i64>().prop_map(Value::I64),
        any::<f64>()
            .prop_filter("NaN != NaN", |x| !x.is_nan())
            .prop_map(Value::F64),
    ]
}

fn array() -> impl Strategy<Value = Array> {
    let leaf = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..20).prop_map(Array::U8),
        prop::collection::vec(any::<i8>(), 0..20).prop_map(Array::I8),
        prop::collection::vec(any::<u16>(), 0..20).prop_map(Array::U16),
        prop::collection::vec(any::<i16>(), 0..20).prop_map(Array::I16),
        prop::collection::vec(any::<u32>(), 0..20).prop_map(Array::U32),
        prop::collection::vec(any::<i32>(), 0..20).prop_map(Array::I32),
        prop::collection::vec(-1e30f32..1e30, 0..20).prop_map(Array::F32),
        prop::collection::vec(any::<bool>(), 0..20).prop_map(Array::Bool),
        prop::collection::vec(".{0,12}", 0..20).prop_map(Array::String),
        prop::collection::vec(any::<u64>(), 0..20).prop_map(Array::U64),
        prop::collection::vec(any::<i64>(), 0..20).prop_map(Array::I64),
        prop::collection::vec(-1e300f64..1e300, 0..20).prop_map(Array::F64),
    ];
    leaf.prop_recursive(3, 40, 5, |inner| {
        prop::collection::vec(inner, 0..5).prop_map(Array::Array)
    })
}

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![3 => scalar_value(), 1 => array().prop_map(Value::Array)]
}

/// A tensor: type, dims (first a whole number of blocks), and data bytes.
fn tensor() -> impl Strategy<Value = (GgmlType, Vec<u64>, Vec<u8>)> {
    let types = vec![
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::IQ2_S,
        GgmlType::Q2_0,
        GgmlType::I8,
    ];
    (
        prop::sample::select(types),
        1u64..3,
        prop::collection::vec(1u64..4, 0..3),
    )
        .prop_flat_map(|(ty, blocks, rest)| {
            let mut dims = vec![blocks * ty.block_elems()];
            dims.extend(rest);
            let bytes = ty.bytes_for(dims.iter().product()).unwrap() as usize;
            (
                Just(ty),
                Just(dims),
                prop::collection::vec(any::<u8>(), bytes),
            )
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn written_files_read_back_identically(
        kvs in prop::collection::vec(("[a-z.]{1,16}", value()), 0..8),
        tensors in prop::collection::vec(tensor(), 0..6),
        alignment in prop::sample::select(vec![None, Some(1u32), Some(8), Some(32), Some(64)]),
    ) {
        let mut w = GgufWriter::new();
        for (k, v) in &kvs {
            w.set(k.clone(), v.clone());
        }
        if let Some(a) = alignment {
            w.set("general.alignment", Value::U32(a));
        }
        for (i, (ty, dims, data)) in tensors.iter().enumerate() {
            w.add_tensor(format!("t{i}"), dims, *ty, TensorSource::Bytes(data)).unwrap();
        }
        let bytes = w.to_bytes().unwrap();
        let g = Gguf::parse(&bytes).unwrap();
        prop_assert_eq!(&g.metadata, w.metadata_mut());
        prop_assert_eq!(g.alignment, u64::from(alignment.unwrap_or(32)));
        prop_assert_eq!(g.tensors.len(), tensors.len());
        for (info, (ty, dims, data)) in g.tensors.iter().zip(&tensors) {
            prop_assert_eq!(info.ty, *ty);
            prop_assert_eq!(&info.dims, dims);
            prop_assert_eq!(info.offset % g.alignment, 0);
            let start = (g.data_offset + info.offset) as usize;
            prop_assert_eq!(&bytes[start..start + data.len()], &data[..]);
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = Gguf::parse(&bytes);
    }
}

#[test]
fn gguf_v2_is_read_and_v1_refused() {
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("llama".into()));
    let mut bytes = w.to_bytes().unwrap();
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    assert_eq!(Gguf::parse(&bytes).unwrap().version, 2);
    bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    let err = Gguf::parse(&bytes).unwrap_err();
    assert_eq!(err.kind, ParseErrorKind::UnsupportedVersion(1));
    bytes[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert_eq!(
        Gguf::parse(&bytes).unwrap_err().kind,
        ParseErrorKind::BigEndian(3)
    );
}

#[test]
fn overlapping_and_misaligned_tensors_are_refused() {
    let data = [0u8; 64];
    let mut w = GgufWriter::new();
    w.add_tensor("a", &[16], GgmlType::F32, TensorSource::Bytes(&data))
        .unwrap();
    w.add_tensor("b", &[16], GgmlType::F32, TensorSource::Bytes(&data))
        .unwrap();
    let bytes = w.to_bytes().unwrap();
    let layout = FieldLayout::of(&bytes);
    let mut bad = bytes.clone();
    // b's offset := a's offset (0): the two overlap.
    bad[layout.tensors[1].offset_at..][..8].copy_from_slice(&0u64.to_le_bytes());
    assert!(matches!(
        Gguf::parse(&bad).unwrap_err().kind,
        ParseErrorKind::TensorsOverlap { .. }
    ));
    let mut bad = bytes.clone();
    bad[layout.tensors[1].offset_at..][..8].copy_from_slice(&65u64.to_le_bytes());
    assert!(matches!(
        Gguf::parse(&bad).unwrap_err().kind,
        ParseErrorKind::MisalignedTensor { .. }
    ));
    let mut bad = bytes.clone();
    bad[layout.tensors[0].dims_at..][..8].copy_from_slice(&17u64.to_le_bytes());
    assert!(matches!(
        Gguf::parse(&bad).unwrap_err().kind,
        ParseErrorKind::TensorsOverlap { .. }
    ));
}

// ---------------------------------------------------------------- corruption

/// Byte offsets of the length and count fields of a parsed file, computed by walking
/// the parsed structure with the encoding's sizes.
struct FieldLayout {
    kvs: Vec<KvLayout>,
    tensors: Vec<TensorLayout>,
    header_end: usize,
}

struct KvLayout {
    start: usize,
    type_at: usize,
    /// Offset of the string length or array element type, when the value has one.
    value_at: usize,
    is_array: bool,
    is_string: bool,
}

struct TensorLayout {
    start: usize,
    n_dims_at: usize,
    dims_at: usize,
    type_at: usize,
    offset_at: usize,
}

fn encoded_len(v: &Value) -> usize {
    match v {
        Value::U8(_) | Value::I8(_) | Value::Bool(_) => 1,
        Value::U16(_) | Value::I16(_) => 2,
        Value::U32(_) | Value::I32(_) | Value::F32(_) => 4,
        Value::U64(_) | Value::I64(_) | Value::F64(_) => 8,
        Value::String(s) => 8 + s.len(),
        Value::Array(a) => array_len(a),
    }
}

fn array_len(a: &Array) -> usize {
    12 + match a {
        Array::U8(v) => v.len(),
        Array::I8(v) => v.len(),
        Array::Bool(v) => v.len(),
        Array::U16(v) => 2 * v.len(),
        Array::I16(v) => 2 * v.len(),
        Array::U32(v) => 4 * v.len(),
        Array::I32(v) => 4 * v.len(),
        Array::F32(v) => 4 * v.len(),
        Array::U64(v) => 8 * v.len(),
        Array::I64(v) => 8 * v.len(),
        Array::F64(v) => 8 * v.len(),
        Array::String(v) => v.iter().map(|s| 8 + s.len()).sum(),
        Array::Array(v) => v.iter().map(array_len).sum(),
    }
}

impl FieldLayout {
    fn of(bytes: &[u8]) -> FieldLayout {
        Self::of_header(bytes, bytes.len() as u64)
    }

    fn of_header(head: &[u8], file_len: u64) -> FieldLayout {
        let g = Gguf::parse_header(head, file_len).expect("the original parses");
        let mut pos = 24;
        let mut kvs = Vec::new();
        for (key, value) in g.metadata.iter() {
            let start = pos;
            let type_at = start + 8 + key.len();
            let value_at = type_at + 4;
            kvs.push(KvLayout {
                start,
                type_at,
                value_at,
                is_array: matches!(value, Value::Array(_)),
                is_string: matches!(value, Value::String(_)),
            });
            pos = value_at + encoded_len(value);
        }
        let mut tensors = Vec::new();
        for t in &g.tensors {
            let start = pos;
            let n_dims_at = start + 8 + t.name.len();
            let dims_at = n_dims_at + 4;
            let type_at = dims_at + 8 * t.dims.len();
            let offset_at = type_at + 4;
            tensors.push(TensorLayout {
                start,
                n_dims_at,
                dims_at,
                type_at,
                offset_at,
            });
            pos = offset_at + 8;
        }
        assert_eq!(
            pos.next_multiple_of(g.alignment as usize) as u64,
            g.data_offset
        );
        FieldLayout {
            kvs,
            tensors,
            header_end: g.data_offset as usize,
        }
    }
}

/// One corruption: a description, the bytes to write at an offset, and the file
/// length the parser is told.
struct Mutation {
    what: String,
    at: usize,
    bytes: Vec<u8>,
    file_len: u64,
}

fn mutations(layout: &FieldLayout, head: &[u8], file_len: u64) -> Vec<Mutation> {
    let u64s = |v: u64| v.to_le_bytes().to_vec();
    let u32s = |v: u32| v.to_le_bytes().to_vec();
    let set = |what: String, at: usize, bytes: Vec<u8>| Mutation {
        what,
        at,
        bytes,
        file_len,
    };
    let cut = |what: String, len: usize| Mutation {
        what,
        at: 0,
        bytes: vec![],
        file_len: len as u64,
    };
    let read_u64 = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().unwrap());

    let mut m = vec![
        set("bad magic".into(), 0, b"GGML".to_vec()),
        set("version 0".into(), 4, u32s(0)),
        set("version 4".into(), 4, u32s(4)),
        set("tensor count u64::MAX".into(), 8, u64s(u64::MAX)),
        set("tensor count 2^40".into(), 8, u64s(1 << 40)),
        set("metadata count u64::MAX".into(), 16, u64s(u64::MAX)),
        set("metadata count + 1".into(), 16, u64s(read_u64(16) + 1)),
        cut("empty file".into(), 0),
        cut("data section cut by one byte".into(), file_len as usize - 1),
    ];
    for len in [1, 3, 4, 7, 8, 15, 16, 23] {
        m.push(cut(format!("truncated at byte {len}"), len));
    }
    m.push(cut(
        "truncated at the data section".into(),
        layout.header_end,
    ));
    for (i, kv) in layout.kvs.iter().enumerate() {
        m.push(set(
            format!("kv {i}: key length u64::MAX"),
            kv.start,
            u64s(u64::MAX),
        ));
        m.push(set(
            format!("kv {i}: key length 2^62"),
            kv.start,
            u64s(1 << 62),
        ));
        m.push(set(format!("kv {i}: value type 13"), kv.type_at, u32s(13)));
        m.push(cut(format!("kv {i}: truncated at its start"), kv.start));
        m.push(cut(
            format!("kv {i}: truncated inside its value"),
            kv.value_at + 2,
        ));
        if kv.is_string {
            m.push(set(
                format!("kv {i}: string length u64::MAX"),
                kv.value_at,
                u64s(u64::MAX),
            ));
            m.push(set(
                format!("kv {i}: string length past the end"),
                kv.value_at,
                u64s(file_len),
            ));
        }
        if kv.is_array {
            let count_at = kv.value_at + 4;
            m.push(set(
                format!("kv {i}: array element type 99"),
                kv.value_at,
                u32s(99),
            ));
            m.push(set(
                format!("kv {i}: array count u64::MAX"),
                count_at,
                u64s(u64::MAX),
            ));
            m.push(set(
                format!("kv {i}: array count 2^40"),
                count_at,
                u64s(1 << 40),
            ));
            m.push(set(
                format!("kv {i}: array count + 1"),
                count_at,
                u64s(read_u64(count_at) + 1),
            ));
        }
    }
    let n = layout.tensors.len();
    for i in [0, 1, n / 2, n - 2, n - 1] {
        let t = &layout.tensors[i];
        m.push(set(
            format!("tensor {i}: name length u64::MAX"),
            t.start,
            u64s(u64::MAX),
        ));
        m.push(set(format!("tensor {i}: 5 dims"), t.n_dims_at, u32s(5)));
        m.push(set(
            format!("tensor {i}: 0xffffffff dims"),
            t.n_dims_at,
            u32s(u32::MAX),
        ));
        m.push(set(
            format!("tensor {i}: dim0 overflows"),
            t.dims_at,
            u64s(u64::MAX / 2),
        ));
        m.push(set(
            format!("tensor {i}: dim0 doubled"),
            t.dims_at,
            u64s(read_u64(t.dims_at) * 2),
        ));
        m.push(set(
            format!("tensor {i}: dim0 + 1"),
            t.dims_at,
            u64s(read_u64(t.dims_at) + 1),
        ));
        m.push(set(
            format!("tensor {i}: unknown type 31"),
            t.type_at,
            u32s(31),
        ));
        m.push(set(format!("tensor {i}: type 1000"), t.type_at, u32s(1000)));
        m.push(set(
            format!("tensor {i}: offset past the end"),
            t.offset_at,
            u64s(file_len),
        ));
        m.push(set(
            format!("tensor {i}: offset u64::MAX - 31"),
            t.offset_at,
            u64s(u64::MAX - 31),
        ));
        m.push(set(
            format!("tensor {i}: offset misaligned"),
            t.offset_at,
            u64s(read_u64(t.offset_at) + 1),
        ));
        m.push(cut(
            format!("tensor {i}: truncated in its info"),
            t.dims_at + 3,
        ));
    }
    let last = &layout.tensors[n - 1];
    let first_offset = read_u64(layout.tensors[0].offset_at);
    m.push(set(
        "last tensor moved onto the first".into(),
        last.offset_at,
        u64s(first_offset),
    ));
    m
}

/// Corrupts the header of the model `name` every way [`mutations`] lists and checks
/// each gives an error, fast and without a large allocation.
fn corrupt_real_model(name: &str) {
    let Some(path) = astra_models::model_for_test(name) else {
        return;
    };
    let file = std::fs::read(&path).unwrap();
    let file_len = file.len() as u64;
    let layout = FieldLayout::of(&file);
    let mut head = file[..layout.header_end].to_vec();
    drop(file);
    let original = Gguf::parse_header(&head, file_len).unwrap();
    let cases = mutations(&layout, &head, file_len);
    assert!(cases.len() > 100, "{} cases", cases.len());
    for case in &cases {
        let saved = head[case.at..case.at + case.bytes.len()].to_vec();
        head[case.at..case.at + case.bytes.len()].copy_from_slice(&case.bytes);
        LARGEST.with(|l| l.set(0));
        let start = Instant::now();
        let result = Gguf::parse_header(&head, case.file_len);
        let elapsed = start.elapsed();
        let largest = LARGEST.with(|l| l.get());
        head[case.at..case.at + case.bytes.len()].copy_from_slice(&saved);
        match result {
            Err(err) => {
                let msg = err.to_string();
                assert!(
                    msg.starts_with("at byte "),
                    "{}: unclear error {msg}",
                    case.what
                );
            }
            Ok(parsed) => panic!(
                "{name}: {} was accepted ({} tensors)",
                case.what,
                parsed.tensors.len()
            ),
        }
        assert!(
            elapsed < Duration::from_millis(500),
            "{}: took {elapsed:?}",
            case.what
        );
        // The largest legitimate allocation is the vocabulary (262144 strings of 24
        // bytes: 6 MiB); a corrupt count must not ask for more than that.
        assert!(
            largest < 16 << 20,
            "{}: allocated {largest} bytes at once",
            case.what
        );
    }
    assert_eq!(
        Gguf::parse_header(&head, file_len).unwrap(),
        original,
        "restored header parses"
    );
    eprintln!(
        "{name}: {} corruptions, each refused with a clear error",
        cases.len()
    );
}

#[test]
fn corrupted_smollm2_headers_are_refused() {
    corrupt_real_model("smollm2-135m");
}

#[test]
fn corrupted_gemma3_headers_are_refused() {
    corrupt_real_model("gemma3-270m");
}

#[test]
fn real_models_have_the_expected_shape() {
    for (name, arch, blocks, tensors) in [
        ("smollm2-135m", "llama", 30, 272),
        ("gemma3-270m", "gemma3", 18, 236),
    ] {
        let Some(path) = astra_models::model_for_test(name) else {
            continue;
        };
        let f = astra_gguf::GgufFile::open(&path).unwrap();
        assert_eq!(f.metadata().str("general.architecture").unwrap(), arch);
        assert_eq!(
            f.metadata().u64(&format!("{arch}.block_count")).unwrap(),
            blocks
        );
        assert_eq!(f.tensors().len(), tensors);
        let total: u64 = f.tensors().iter().map(|t| t.size).sum();
        assert!(total <= f.len() - f.header().data_offset);
    }
}
