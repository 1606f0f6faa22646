//! Fuzzes the GGUF parser: any input must parse or give an error, never panic, hang or
//! allocate without bound. A successful parse must also describe tensors that lie
//! inside the input, which the parser promises.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(g) = astra_gguf::Gguf::parse(data) {
        for t in &g.tensors {
            let end = g.data_offset + t.offset + t.size;
            assert!(end <= data.len() as u64, "tensor {} ends past the input", t.name);
        }
    }
});
