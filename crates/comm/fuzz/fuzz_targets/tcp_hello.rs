//! What a TCP ring rank reads from a connection before it is authenticated: any 48 bytes
//! decode to a hello or a refusal, never a panic, and a decoded hello re-encodes to the
//! same bytes; the acceptor's whole handshake against any input refuses it, since no input
//! can prove the token it was never given.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_comm::collective::tcp::fuzzing::{HELLO_BYTES, accept, decode_hello};

fuzz_target!(|data: &[u8]| {
    if let Some(head) = data.get(..HELLO_BYTES) {
        let decoded = decode_hello(head).expect("a hello is exactly HELLO_BYTES bytes");
        if let Ok(hello) = decoded {
            assert_eq!(&hello.encode()[..], head);
            let _ = hello.expect(0, 2);
        }
    }
    assert!(decode_hello(data).is_some() == (data.len() == HELLO_BYTES));
    assert!(accept(data).is_err(), "authenticated without the token");
});
