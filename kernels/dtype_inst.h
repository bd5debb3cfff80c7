/* One instance of PB_T_BODY for the parameters dtype_t.h has just set;
 * then the parameters are cleared for the next.  Only dtype_t.h includes
 * this. */
#include PB_T_BODY
#undef T
#undef RT
#undef CT
#undef DT
#undef RDT
#undef CDT
#undef CPLX
#undef ACC
#undef SFX
#undef CSFX
#undef MSFX
#undef LP
#undef LP_CHAR
#undef WORD
#undef LANES
#undef RE
#undef IM
#undef ABS
#undef CONJ
#undef SCAL
#undef TSCALAR
